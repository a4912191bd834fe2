#!/usr/bin/env bash
# The KV-cache proof, for a machine with an NVIDIA GPU and no Rust toolchain: build here
# with `scripts/gpu-kit.sh` (it puts `xfer` and this script in gpu-kit/), copy gpu-kit/ to
# the GPU machine, and there run:
#
#   bash gpu-kit/kv-proof.sh
#
# `xfer kv-bench`: a Llama-3-8B-shaped request (32 layers, 8 KV heads x 128 BF16, blocks
# of 16, 4096 tokens: 512 MiB) from 2 prefill ranks into 4 decode ranks, each rank a
# process on GPU 0 with vLLM's per-layer caches and random block tables, timed per request
# (median of 5 after one untimed) against a plain paged write of the same bytes between
# the same processes:
#   1. cuda-ipc, NHD (FlashAttention) and HND (FlashInfer);
#   2. tcp with GPU memory at 1, 4 and 8 rails (NHD);
#   3. streaming over cuda-ipc: each layer computed by a 200 us kernel and pushed when it
#      is saved; the time from the last save to the decode ranks' notes.
# The JSON lines go to kv-*.json beside the log. XFER_KV_MEMORY=host runs the tcp steps on
# host memory (a check of the script on a machine without a GPU). Exits non-zero when any
# step failed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
# shellcheck source=scripts/proof-lib.sh
source ./proof-lib.sh
memory=${XFER_KV_MEMORY:-cuda}
if [[ $memory == cuda ]]; then proof_machine; else export XFER_REQUIRE_CUDA=0; fi
kv() { # NAME ARGS...
    local name=$1
    shift
    ./xfer kv-bench --json --memory "$memory" "$@" | tee "kv-$name.json"
}
if [[ $memory == cuda ]]; then
    step "kv cuda-ipc nhd" kv ipc-nhd --transport cuda-ipc --order nhd
    step "kv cuda-ipc hnd" kv ipc-hnd --transport cuda-ipc --order hnd
fi
for rails in 1 4 8; do
    step "kv tcp x$rails" kv "tcp-$rails" --transport tcp --rails "$rails" --requests 3
done
if [[ $memory == cuda ]]; then
    step "kv streaming" kv stream --transport cuda-ipc --layer-us 200
fi
proof_verdict
