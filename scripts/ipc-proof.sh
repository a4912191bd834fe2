#!/usr/bin/env bash
# The CUDA IPC proof run (issue 9), for a machine with NVIDIA GPUs and no Rust toolchain.
#
# Build here, then carry the binaries over (e.g. the device tool's `carry`):
#   cargo build --release -p xfer-cli
#   cargo test --release -p transport-cuda-ipc -p gpu-mem --no-run   # note the conformance, processes and cuda executables
#   mkdir -p .carry/gpu && cp target/release/xfer .carry/gpu/ \
#     && cp <conformance exe> .carry/gpu/ipc_conformance_tests \
#     && cp <processes exe> .carry/gpu/ipc_process_tests && cp <cuda exe> .carry/gpu/gpu_mem_cuda_tests \
#     && cp scripts/ipc-proof.sh .carry/gpu/
# There: bash .carry/gpu/ipc-proof.sh   (tests fail instead of skipping; GPU0->GPU1 parts run when 2 GPUs exist)
set -u
cd "$(dirname "$0")"
export XFER_REQUIRE_CUDA=1
X=./xfer
ngpu=$(nvidia-smi -L | wc -l)
echo "== machine: $(nproc) cores, $ngpu GPU(s)"; nvidia-smi -L
$X info | grep -A3 -E "^CUDA|^cuda-ipc"
echo "== tests"
./gpu_mem_cuda_tests --test-threads=1 --nocapture 2>&1 | grep -E "test result|FAILED|panicked|copy method"
./ipc_conformance_tests --test-threads=1 2>&1 | grep -E "test result|FAILED|panicked"
./ipc_process_tests --test-threads=1 --nocapture 2>&1 | grep -E "test result|FAILED|panicked|target process|after the target|copy method"
d() { echo "== demo $*"; $X demo --transport cuda-ipc --memory cuda --baseline --json "$@"; }
for r in 1 4 8; do d --gpus 0 --rails "$r" --page-size 64KiB --pages 10000 --bytes 64GiB; done
d --gpus 0 --rails 8 --page-size 4KiB --pages 100000 --bytes 8GiB
if [ "$ngpu" -ge 2 ]; then
  for r in 1 4 8; do d --gpus 0,1 --rails "$r" --page-size 64KiB --pages 10000 --bytes 128GiB; done
  d --gpus 0,1 --rails 8 --page-size 4KiB --pages 100000 --bytes 16GiB
  for m in batch memcpy; do
    echo "== XFER_CUDA_COPY=$m"
    XFER_CUDA_COPY=$m $X demo --transport cuda-ipc --memory cuda --gpus 0,1 --rails 8 --page-size 64KiB --pages 10000 --bytes 64GiB --json
  done
fi
# Two processes (auto picks cuda-ipc): a server per GPU, benches from GPU 0.
for g in $(seq 0 $((ngpu - 1))); do
  echo "== two processes, auto: serve on GPU $g, bench from GPU 0"
  port=$((7475 + g))
  $X serve --memory cuda --gpus $g --rails 8 --listen 127.0.0.1:$port > serve$g.log 2>&1 &
  sp=$!
  for _ in $(seq 100); do grep -q "xfer bench" serve$g.log && break; sleep 0.2; done
  for r in 1 8; do
    $X bench --peer xfer://127.0.0.1:$port --memory cuda --gpus 0 --rails $r --page-size 64KiB --pages 10000 --bytes 128GiB --json
  done
  $X bench --peer xfer://127.0.0.1:$port --memory cuda --gpus 0 --rails 8 --page-size 4KiB --pages 100000 --bytes 16GiB --json
  kill $sp; wait $sp 2>/dev/null; cat serve$g.log
done
