#!/usr/bin/env bash
# The GPU proof run of the TCP path, for a machine with NVIDIA GPUs and no Rust toolchain.
# Build here with `scripts/gpu-kit.sh` (it puts the binaries and these scripts in gpu-kit/),
# copy that folder to the GPU machine by any means, and there run: bash gpu-kit/gpu-proof.sh
# Every hardware test runs (--include-ignored; the two-GPU ones where two GPUs exist) and
# fails where its hardware is missing; the script exits non-zero when any test or run fails.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
# shellcheck source=scripts/proof-lib.sh
source ./proof-lib.sh
X=./xfer
proof_machine
hw_tests ./tcp_gpu_tests
hw_tests ./gpu_mem_cuda_tests
hw_tests ./gpu_one_agent_tests
hw_tests ./gpu_kv_tests
# --baseline only with host memory: GPU memory over tcp has no raw equivalent in one process.
d() { step "demo $*" $X demo --transport tcp --page-size 64KiB --pages 1000 --bytes 16GiB --json "$@"; }
for r in 1 4 8; do d --memory cuda --gpus 0 --rails "$r" --pin off; done
d --memory host --rails 8 --baseline
if ((ngpu >= 2)); then
  step topo $X topo
  for r in 4 8; do d --memory cuda --gpus 0,1 --rails "$r"; done
  for m in cuda host; do
    step "per-gpu tcp $m" $X demo --per-gpu --transport tcp --memory $m --gpus 0,1 --rails 4 --page-size 64KiB --pages 1000 --bytes 16GiB
  done
  step "per-gpu auto" $X demo --per-gpu --memory cuda --gpus 0,1 --rails 4 --page-size 64KiB --pages 10000 --bytes 64GiB
  echo "== serve --per-gpu and bench --per-gpu (two processes; auto = cuda-ipc, then tcp)"
  $X serve --per-gpu --memory cuda --gpus 0,1 --rails 4 --listen 127.0.0.1:7480 > serve-per-gpu.log 2>&1 &
  sp=$!
  for _ in $(seq 100); do grep -q "xfer bench" serve-per-gpu.log && break; sleep 0.2; done
  step "bench per-gpu auto" $X bench --peer xfer://127.0.0.1:7480 --per-gpu --memory cuda --gpus 0,1 --rails 4 --pages 10000 --bytes 64GiB
  step "bench per-gpu tcp" $X bench --peer xfer://127.0.0.1:7480 --per-gpu --transport tcp --memory cuda --gpus 0,1 --rails 4 --pages 1000 --bytes 16GiB
  kill $sp; wait $sp 2>/dev/null || true; cat serve-per-gpu.log
  echo "== both directions at once"
  $X demo --transport tcp --memory cuda --gpus 0,1 --rails 8 --bytes 16GiB --json & a=$!
  $X demo --transport tcp --memory cuda --gpus 1,0 --rails 8 --bytes 16GiB --json & b=$!
  wait $a || proof_failed+=("both directions 0,1")
  wait $b || proof_failed+=("both directions 1,0")
fi
proof_verdict
