#!/usr/bin/env bash
# Builds what the GPU proof runs need and puts it in .carry/gpu/ (ignored by git), for a GPU
# machine that has no Rust toolchain: the release `xfer`, the hardware test executables
# under fixed names, and the scripts that run them. Then, there (e.g. the device tool with
# `carry: [".carry"]`):
#   bash .carry/gpu/gpu-proof.sh    # TCP with GPU memory: tests and figures
#   bash .carry/gpu/ipc-proof.sh    # CUDA IPC: tests and figures
#   bash .carry/gpu/efa-hmem-proof.sh LF   # libfabric with FI_HMEM (LF: a CUDA-enabled
#                                          # libfabric prefix, see the script)
#   XFER=.carry/gpu/xfer bash .carry/gpu/efa-small.sh LF   # small writes against fi_rma_bw
#   bash .carry/gpu/bench.sh        # docs/benchmarks.md's figures on that machine
#   bash .carry/gpu/weights-proof.sh [WHEEL]   # weight sync: 2 -> 2 processes, 16 GiB of
#                                              # GPU weights, cuda-ipc and tcp x8; Python
#   .carry/gpu/sim_p5 8 4 3         # the engine alone at p5 scale (see benches/examples)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=.carry/gpu
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
    [ -x "$exe" ] || { echo "gpu-carry: no executable for -p $1 --test $2" >&2; exit 1; }
    cp "$exe" "$out/$3"
}
copy gpu-mem cuda gpu_mem_cuda_tests
copy transport-tcp gpu tcp_gpu_tests
copy transport-cuda-ipc conformance ipc_conformance_tests
copy transport-cuda-ipc processes ipc_process_tests
copy transport-efa hmem_cuda efa_hmem_tests
copy transport-efa shm_cuda_one_process efa_hmem_one_process
copy transport-efa stream_order_shm efa_stream_order
strip "$out"/* 2>/dev/null || true
cp scripts/gpu-proof.sh scripts/ipc-proof.sh scripts/efa-hmem-proof.sh scripts/efa-small.sh scripts/proof-lib.sh \
    scripts/bench.sh scripts/weights-proof.sh "$out/"
# The Python weight-sync example and its tests, for weights-proof.sh with a wheel.
mkdir -p "$out/py/examples" "$out/py/tests"
cp xfer-py/examples/weights_llama.py "$out/py/examples/"
cp xfer-py/tests/conftest.py xfer-py/tests/test_weights.py "$out/py/tests/"
echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' (with uncommitted changes)')" >"$out/COMMIT"
du -sh "$out"
