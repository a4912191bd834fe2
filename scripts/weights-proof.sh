#!/usr/bin/env bash
# The weight-sync proof, for a machine with NVIDIA GPUs and no Rust toolchain. Build here
# with `scripts/gpu-kit.sh` (it puts `weights_sync`, this script and the Python example in
# gpu-kit/), then build the wheel into the kit if the Python steps are to run (see
# scripts/py-gpu-proof.sh: `cd xfer-py && maturin build --release -o ../gpu-kit/wheels`),
# copy gpu-kit/ to the GPU machine by any means, and there run:
#
#   bash gpu-kit/weights-proof.sh [gpu-kit/wheels/xfer-*.whl [WHEELHOUSE]]
#
# 1. Rust, 2 source processes -> 2 destination processes, GPU memory: a Llama-3-8B-shaped
#    model of 16 GiB (35 layers, BF16; sources FSDP flat halves, destinations tensor-parallel
#    halves with vLLM's fused qkv/gate_up), pushed over cuda-ipc and over tcp with 8 rails;
#    each round the same agents first write the same bytes per destination as one paged
#    write (64 KiB pages), then sync; medians of 3 rounds after a warm-up, and every byte of
#    every destination checked every round. The JSON summaries go to weights-*.json.
# 2. Python (with WHEEL): the Llama-3-8B example with CUDA tensors, every rank a process of
#    its own (2 trainers at TP=2 -> replicas at TP=4 and TP=1, then a joiner pulls), over
#    tcp and over cuda-ipc (auto), every byte checked; and xfer-py's test_weights.py with
#    XFER_REQUIRE_CUDA=1.
#
# XFER_WEIGHTS_STEPS="rust" or "python" runs one part (each takes several minutes: the
# Rust part about 5, the Python part more, mostly generating and checking 16 GB models).
# XFER_WEIGHTS_MEMORY=host and XFER_WEIGHTS_BYTES (e.g. 2GiB) make a smaller run (the
# python steps then use numpy, one layer): a check of the script itself on a machine
# without a GPU. XFER_WEIGHTS_PY_LAYERS=K runs the Python examples on the model's first K
# layers (same shapes, fewer of them). Exits non-zero when any step failed.
set -euo pipefail
wheel=${1:+$(realpath "$1")}
house=${2:+$(realpath "$2")}
cd "$(dirname "${BASH_SOURCE[0]}")"
# shellcheck source=scripts/proof-lib.sh
source ./proof-lib.sh # step, proof_verdict; exports XFER_REQUIRE_CUDA=1
memory=${XFER_WEIGHTS_MEMORY:-cuda}
bytes=${XFER_WEIGHTS_BYTES:-16GiB}
steps=${XFER_WEIGHTS_STEPS:-rust python}
if [[ $memory == cuda ]]; then proof_machine; else export XFER_REQUIRE_CUDA=0; fi

ws() { # NAME ARGS...: one run of the Rust benchmark
    local name=$1
    shift
    step "weights_sync $name" ./weights_sync memory="$memory" bytes="$bytes" rounds=3 \
        json="weights-$name.json" "$@"
}
if [[ $steps == *rust* ]]; then
    if [[ $memory == cuda ]]; then
        ws cuda-ipc transport=cuda-ipc rails=8
        ws cuda-ipc-1rail transport=cuda-ipc rails=1
    fi
    ws tcp-8rails transport=tcp rails=8
    for f in weights-*.json; do
        [[ -f $f ]] && echo "== $f: $(cat "$f")"
    done
fi
[[ $steps == *python* ]] || { proof_verdict; exit; }

if [[ -z $wheel ]]; then
    echo "== python: no wheel given, skipped (bash $0 WHEEL [WHEELHOUSE] runs it)"
    proof_verdict
    exit
fi
# The machine's python3 with the wheel in a folder of its own on PYTHONPATH, as
# py-gpu-proof.sh does.
py=${PYTHON:-python3}
site=$(mktemp -d)/site
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
pip_args=(-q --disable-pip-version-check --target "$site")
[[ -n $house ]] && pip_args+=(--no-index --find-links "$house")
mods=(numpy pytest)
[[ $memory == cuda ]] && mods+=(torch)
for m in "${mods[@]}"; do
    "$py" -c "import $m" 2>/dev/null || "$py" -m pip install "${pip_args[@]}" "$m"
done
"$py" -m pip install "${pip_args[@]}" --no-deps --force-reinstall "$wheel"
device=cpu
[[ $memory == cuda ]] && device=cuda
layers=()
[[ $memory == cuda ]] || layers=(--layers 1)
[[ -n ${XFER_WEIGHTS_PY_LAYERS:-} ]] && layers=(--layers "$XFER_WEIGHTS_PY_LAYERS")
ex() { step "weights_llama $*" "$py" py/examples/weights_llama.py --device "$device" "${layers[@]}" "$@"; }
ex --transport tcp --rails 8
ex --transport auto                       # cuda-ipc between the ranks' processes (GPU)
ex --model qwen2.5-7b --transport tcp --rails 8
step "pytest test_weights.py" "$py" -m pytest -q -rs py/tests/test_weights.py
proof_verdict
