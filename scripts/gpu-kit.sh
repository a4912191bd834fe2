#!/usr/bin/env bash
# Builds the GPU kit: gpu-kit/ at the repository root (ignored by git), one folder with
# what the GPU proof runs need on a machine with NVIDIA GPUs and no Rust toolchain: the
# release `xfer`, the hardware test executables under fixed names, the scripts that run
# them, and the Python weight-sync example with its tests. Copy the folder to the GPU
# machine by any means (scp -r, rsync, a tarball), then run there, from the folder's parent
# (each script moves into the kit itself):
#   bash gpu-kit/gpu-proof.sh    # TCP with GPU memory: tests and figures
#   bash gpu-kit/ipc-proof.sh    # CUDA IPC: tests and figures
#   bash gpu-kit/efa-hmem-proof.sh LF   # libfabric with FI_HMEM (LF: a CUDA-enabled
#                                       # libfabric prefix, see the script)
#   XFER=gpu-kit/xfer bash gpu-kit/efa-small.sh LF   # small writes against fi_rma_bw
#   bash gpu-kit/bench.sh        # docs/benchmarks.md's figures on that machine
#   bash gpu-kit/kv-proof.sh     # KV cache: prefill TP2 -> decode TP4 processes (kv-bench)
#   bash gpu-kit/weights-proof.sh [WHEEL]   # weight sync: 2 -> 2 processes, 16 GiB of
#                                           # GPU weights, cuda-ipc and tcp x8; Python
#   gpu-kit/sim_p5 8 4 3         # the engine alone at p5 scale (see benches/examples)
# Each run empties gpu-kit/ first. The CUDA-enabled libfabric (scripts/libfabric-2.6.sh
# --cuda) and the Python wheel are built apart; copy them into the kit afterwards to take
# them along (cp -r target/libfabric-2.6-cuda gpu-kit/libfabric; maturin's -o
# ../gpu-kit/wheels, see scripts/py-gpu-proof.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=gpu-kit
rm -rf "$out" && mkdir -p "$out"
cargo build --release -p xfer-cli
cp target/release/xfer "$out/xfer"
# The engine alone at p5 scale (8 workers x 4 rails of a transport that moves no bytes).
cargo build --release -p xfer-benches --example sim_p5
cp target/release/examples/sim_p5 "$out/sim_p5"
# Weight sync between processes, against a paged write of the same bytes (weights-proof.sh).
cargo build --release -p xfer --example weights_sync
cp target/release/examples/weights_sync "$out/weights_sync"
# Test executables: `cargo test --no-run` names each one ("Executable tests/x.rs (PATH)").
copy() { # PACKAGE TEST NAME
    local exe
    exe=$(cargo test --release --no-run -p "$1" --test "$2" 2>&1 |
        sed -n 's/^ *Executable .* (\(.*\))$/\1/p' | tail -n 1)
    [ -x "$exe" ] || { echo "gpu-kit: no executable for -p $1 --test $2" >&2; exit 1; }
    cp "$exe" "$out/$3"
}
copy gpu-mem cuda gpu_mem_cuda_tests
copy transport-tcp gpu tcp_gpu_tests
copy transport-cuda-ipc conformance ipc_conformance_tests
copy transport-cuda-ipc processes ipc_process_tests
copy transport-efa hmem_cuda efa_hmem_tests
copy transport-efa shm_cuda_one_process efa_hmem_one_process
copy transport-efa stream_order_shm efa_stream_order
copy xfer gpu_one_agent gpu_one_agent_tests
copy xfer gpu_kv gpu_kv_tests
strip "$out"/* 2>/dev/null || true
cp scripts/gpu-proof.sh scripts/ipc-proof.sh scripts/efa-hmem-proof.sh scripts/efa-small.sh scripts/proof-lib.sh \
    scripts/bench.sh scripts/weights-proof.sh scripts/kv-proof.sh "$out/"
# The Python weight-sync example and its tests, for weights-proof.sh with a wheel.
mkdir -p "$out/py/examples" "$out/py/tests"
cp xfer-py/examples/weights_llama.py "$out/py/examples/"
cp xfer-py/tests/conftest.py xfer-py/tests/test_weights.py "$out/py/tests/"
echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' (with uncommitted changes)')" >"$out/COMMIT"
du -sh "$out"
echo "Copy $out/ to the GPU machine and run there: bash $out/gpu-proof.sh (the header of scripts/gpu-kit.sh lists the others)" >&2
