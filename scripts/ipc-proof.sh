#!/usr/bin/env bash
# The CUDA IPC proof run, for a machine with NVIDIA GPUs and no Rust toolchain.
# Build here with `scripts/gpu-kit.sh` (it puts the binaries and these scripts in gpu-kit/),
# copy that folder to the GPU machine by any means, and there run: bash gpu-kit/ipc-proof.sh
# Every hardware test runs (--include-ignored; the two-GPU ones where two GPUs exist) and
# fails where its hardware is missing; the script exits non-zero when any test or run fails.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
# shellcheck source=scripts/proof-lib.sh
source ./proof-lib.sh
X=./xfer
proof_machine
step info $X info
hw_tests ./gpu_mem_cuda_tests --nocapture
hw_tests ./ipc_conformance_tests
hw_tests ./ipc_process_tests --nocapture
d() { step "demo $*" $X demo --transport cuda-ipc --memory cuda --baseline --json "$@"; }
for r in 1 4 8; do d --gpus 0 --rails "$r" --page-size 64KiB --pages 10000 --bytes 64GiB; done
d --gpus 0 --rails 8 --page-size 4KiB --pages 100000 --bytes 8GiB
for m in batch memcpy; do d --gpus 0 --rails 8 --page-size 64KiB --pages 10000 --bytes 16GiB --cuda-copy $m; done
if ((ngpu >= 2)); then
  for r in 1 4 8; do d --gpus 0,1 --rails "$r" --page-size 64KiB --pages 10000 --bytes 128GiB; done
  d --gpus 0,1 --rails 8 --page-size 4KiB --pages 100000 --bytes 16GiB
  for m in batch memcpy; do
    d --gpus 0,1 --rails 8 --page-size 64KiB --pages 10000 --bytes 64GiB --cuda-copy $m
  done
fi
# Two processes (auto picks cuda-ipc): a server per GPU, benches from GPU 0.
for g in $(seq 0 $((ngpu - 1))); do
  echo "== two processes, auto: serve on GPU $g, bench from GPU 0"
  port=$((7475 + g))
  $X serve --memory cuda --gpus "$g" --rails 8 --listen 127.0.0.1:$port > "serve$g.log" 2>&1 &
  sp=$!
  for _ in $(seq 100); do grep -q "xfer bench" "serve$g.log" && break; sleep 0.2; done
  b() { step "bench to GPU $g $*" $X bench --peer xfer://127.0.0.1:$port --memory cuda --gpus 0 --json "$@"; }
  for r in 1 8; do b --rails $r --page-size 64KiB --pages 10000 --bytes 128GiB; done
  b --rails 8 --page-size 4KiB --pages 100000 --bytes 16GiB
  kill $sp; wait $sp 2>/dev/null || true; cat "serve$g.log"
done
proof_verdict
