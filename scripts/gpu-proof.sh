#!/usr/bin/env bash
# The GPU proof run (issues 5, 6, 8), for a machine with NVIDIA GPUs and no Rust toolchain.
#
# Build here, then carry the binaries over (e.g. the device tool's `carry`):
#   cargo build --release -p xfer-cli
#   cargo test --release -p transport-tcp --test gpu --no-run   # note the executable path
#   cargo test --release -p gpu-mem --test cuda --no-run
#   mkdir -p .carry/gpu && cp target/release/xfer .carry/gpu/ \
#     && cp <gpu test exe> .carry/gpu/tcp_gpu_tests && cp <cuda test exe> .carry/gpu/gpu_mem_cuda_tests \
#     && cp scripts/gpu-proof.sh .carry/gpu/
# There: bash .carry/gpu/gpu-proof.sh   (GPU tests fail instead of skipping; 2-GPU parts run when 2 exist)
set -u
cd "$(dirname "$0")"
export XFER_REQUIRE_CUDA=1
X=./xfer
ngpu=$(nvidia-smi -L | wc -l)
[ "$ngpu" -ge 2 ] && export XFER_REQUIRE_GPUS=2
echo "== machine: $(nproc) cores, $ngpu GPU(s)"; nvidia-smi -L
echo "== tests"; ./tcp_gpu_tests --test-threads=1 2>&1 | grep -E "test result|FAILED|panicked"
./gpu_mem_cuda_tests --test-threads=1 2>&1 | grep -E "test result|FAILED|panicked"
d() { echo "== demo $*"; $X demo --transport tcp --page-size 64KiB --pages 1000 --bytes 16GiB --baseline --json "$@"; }
for r in 1 4 8; do d --memory cuda --gpus 0 --rails "$r" --pin off; done
echo "== one driver copy per page instead of the copy kernel (XFER_TCP_GPU_COPY=stream)"
XFER_TCP_GPU_COPY=stream $X demo --transport tcp --page-size 64KiB --pages 1000 --bytes 16GiB --json --memory cuda --gpus 0 --rails 8 --pin off
d --memory host --rails 8
if [ "$ngpu" -ge 2 ]; then
  $X topo
  for r in 4 8; do d --memory cuda --gpus 0,1 --rails "$r"; done
  echo "== a worker per GPU (--per-gpu), 4 rails each"
  $X demo --per-gpu --transport tcp --memory cuda --gpus 0,1 --rails 4 --page-size 64KiB --pages 1000 --bytes 16GiB
  $X demo --per-gpu --transport tcp --memory host --gpus 0,1 --rails 4 --page-size 64KiB --pages 1000 --bytes 16GiB
  $X demo --per-gpu --memory cuda --gpus 0,1 --rails 4 --page-size 64KiB --pages 10000 --bytes 64GiB
  echo "== serve --per-gpu and bench --per-gpu (two processes; auto = cuda-ipc, then tcp)"
  $X serve --per-gpu --memory cuda --gpus 0,1 --rails 4 --listen 127.0.0.1:7480 > serve-per-gpu.log 2>&1 &
  sp=$!
  for _ in $(seq 100); do grep -q "xfer bench" serve-per-gpu.log && break; sleep 0.2; done
  $X bench --peer xfer://127.0.0.1:7480 --per-gpu --memory cuda --gpus 0,1 --rails 4 --pages 10000 --bytes 64GiB
  $X bench --peer xfer://127.0.0.1:7480 --per-gpu --transport tcp --memory cuda --gpus 0,1 --rails 4 --pages 1000 --bytes 16GiB
  kill $sp; wait $sp 2>/dev/null; cat serve-per-gpu.log
  echo "== both directions at once"
  $X demo --transport tcp --memory cuda --gpus 0,1 --rails 8 --bytes 16GiB --json &
  $X demo --transport tcp --memory cuda --gpus 1,0 --rails 8 --bytes 16GiB --json &
  wait
fi
