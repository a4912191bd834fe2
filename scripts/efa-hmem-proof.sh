#!/usr/bin/env bash
# The GPU proof of the libfabric path (transport-efa with FI_HMEM), for a machine with an
# NVIDIA GPU and no Rust toolchain: CUDA memory through libfabric's shm provider, tested and
# measured against the provider's own benchmark (fabtests' fi_rma_bw) in the same run.
#
#   bash gpu-kit/efa-hmem-proof.sh LF_PREFIX
#
# LF_PREFIX is a libfabric built with CUDA and fabtests by `scripts/libfabric-2.6.sh --cuda
# CUDA_DIR`. Build the rest here with scripts/gpu-kit.sh, put the libfabric prefix in the
# kit (cp -r target/libfabric-2.6-cuda gpu-kit/libfabric), copy gpu-kit/ to the GPU machine
# by any means, and there run `bash gpu-kit/efa-hmem-proof.sh libfabric` (a relative
# LF_PREFIX is read from the kit's folder, where this script runs; an absolute one from
# anywhere). Every step is counted; the script exits non-zero when a test fails, a run does
# not verify, or a step hangs past its timeout.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
# shellcheck source=scripts/proof-lib.sh
source ./proof-lib.sh
LF=$(cd "${1:?usage: efa-hmem-proof.sh LF_PREFIX}" && pwd)
export XFER_LIBFABRIC=$LF/lib/libfabric.so.1
export FI_PROVIDER_PATH=$LF/lib/libfabric
export XFER_REQUIRE_HMEM=1 XFER_REQUIRE_LIBFABRIC=1
BENCH_ENV=${BENCH_ENV:-}
X=./xfer
RUNS=${RUNS:-3}
proof_machine
step "fi_info shm FI_HMEM" env LD_LIBRARY_PATH="$LF/lib" "$LF/bin/fi_info" -p shm -c FI_HMEM -t FI_EP_RDM
step "xfer info" $X info

# Tests, each bounded: a hang fails its step instead of the run.
step "tests efa_hmem" timeout 300 ./efa_hmem_tests --include-ignored --test-threads=1
step "tests efa_hmem_one_process" timeout 120 ./efa_hmem_one_process --include-ignored --test-threads=1
step "tests efa_stream_order" timeout 120 ./efa_stream_order --include-ignored --test-threads=1

# fi_rma_bw, one run: two processes, 64 KiB writes with remote CQ data and delivery
# completion (-U, as every write of ours asks for), a window of 64. Prints MB/s (fabtests' MB
# is 10^6 bytes). It posts a window and waits for all of it before the next.
rma_bw() { # provider [extra args...]
    local prov=$1 port=$((9300 + RANDOM % 500)) out
    shift
    env LD_LIBRARY_PATH="$LF/lib" timeout 60 "$LF/bin/fi_rma_bw" -p "$prov" -E"$port" -U -o writedata -S 65536 -W 64 -I 20000 "$@" >/dev/null 2>&1 &
    local srv=$!
    sleep 0.5
    out=$(env LD_LIBRARY_PATH="$LF/lib" timeout 60 "$LF/bin/fi_rma_bw" -p "$prov" -E"$port" -U -o writedata -S 65536 -W 64 -I 20000 "$@" 127.0.0.1 2>&1 | awk '/^64k/ {print $5}')
    wait $srv || true
    echo "${out:-0}"
}

# xfer bench against xfer serve, two processes, one run: prints Gbps, or fails. The working
# set is REGION (4MiB: the size of fi_rma_bw's 64-write window) with PAGES pages a transfer;
# REGION=1GiB PAGES=1000 is the default bench's (random pages of 1 GiB, DRAM-bound).
bench() { # provider memory rails [bench args...]
    local prov=$1 mem=$2 rails=$3 port=$((7500 + RANDOM % 400))
    shift 3
    local gpus=()
    [[ $mem == cuda ]] && gpus=(--gpus 0)
    env $BENCH_ENV timeout 120 $X serve --transport efa --provider "$prov" --memory "$mem" "${gpus[@]}" \
        --listen 127.0.0.1:$port --rails "$rails" --region-size "${REGION:-4MiB}" >serve.log 2>&1 &
    local srv=$!
    for _ in $(seq 100); do grep -q "xfer bench" serve.log && break; sleep 0.1; done
    local json
    json=$(env $BENCH_ENV timeout 120 $X bench --peer xfer://127.0.0.1:$port --transport efa --provider "$prov" \
        --memory "$mem" "${gpus[@]}" --rails "$rails" --region-size "${REGION:-4MiB}" --page-size 64KiB \
        --pages "${PAGES:-64}" --bytes 8GiB --json "$@" 2>bench.err) || {
        kill $srv 2>/dev/null; cat bench.err serve.log >&2; return 1; }
    kill $srv 2>/dev/null; wait $srv 2>/dev/null || true
    python3 -c 'import json,sys; d=json.loads(sys.argv[1]); assert d["verified"], d; print(round(d["gbps"],2))' "$json"
}

median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

# One comparison row: fi_rma_bw and our bench interleaved, RUNS times each. `--provider tcp`
# opens the native tcp endpoint where libfabric 2.x lists it beside `tcp;ofi_rxm`, as
# `fi_rma_bw -p tcp` does.
row() { # provider memory rails [bench args...]
    local prov=$1 mem=$2 rails=$3
    shift 3
    local fi=() us=() d=() fp=$prov
    [[ $mem == cuda ]] && d=(-D cuda)
    for _ in $(seq "$RUNS"); do
        fi+=("$(rma_bw "$fp" "${d[@]}")")
        us+=("$(bench "$prov" "$mem" "$rails" "$@")") || { proof_failed+=("bench $prov $mem x$rails $*"); return; }
    done
    local fim usm
    fim=$(median "${fi[@]}")
    usm=$(median "${us[@]}")
    python3 - "$prov" "$mem" "$rails" "$fim" "$usm" "${fi[*]}" "${us[*]}" "$*" <<'PY'
import sys
prov, mem, rails, fi, us, fis, uss, args = sys.argv[1:]
fi_gbps = float(fi) * 8 / 1000
print(f"| {prov} | {mem} | {rails} | {args or '-'} | fi_rma_bw {fi_gbps:.1f} Gbps ({fis} MB/s) | xfer {float(us):.1f} Gbps ({uss}) | ratio {float(us)/fi_gbps if fi_gbps else 0:.2f} |")
PY
}

# Which registration path CUDA memory took (dmabuf first, then by address): the bench's
# regions come from gpu-mem, which exports a dmabuf; the tests' own buffers have none.
echo "== registration paths (RUST_LOG=transport_efa=debug)"
BENCH_ENV=RUST_LOG=transport_efa=debug bench shm cuda 1 >/dev/null 2>&1 || true
grep -ho 'CUDA memory registered [a-z ]*' serve.log bench.err | sort | uniq -c || true

echo "== speed: 64 KiB writes, two processes, ${REGION:-4MiB} working set, medians of $RUNS (MB/s of fi_rma_bw are 10^6 B/s)"
echo "(4 rails are four endpoints against fi_rma_bw's one; --depth 1 is fi_rma_bw's post-a-window-then-wait shape)"
for mem in host cuda; do
    for rails in 1 4; do row shm "$mem" "$rails"; done
    row shm "$mem" 1 --depth 1
done
for rails in 1 4; do row tcp host "$rails"; done
proof_verdict
