#!/usr/bin/env bash
# Small writes through the efa backend against libfabric's own benchmark, operations per
# second, over a provider between two processes, host memory (shm; PROVIDER=tcp for
# libfabric's tcp provider over loopback): `xfer bench --transport efa --provider P`
# (against `xfer serve`) and fabtests' `fi_rma_bw -o writedata -U` with
# the same write size and 64 writes in flight (fi_rma_bw's window; the bench keeps 4
# transfers of 16 writes in flight per rail over a 4 MiB working set, `--depth 4*RAILS
# --pages 16`; SHAPE="--depth 1 --pages 64" posts 64 and waits for them, as fi_rma_bw
# does), runs interleaved. RAILS=4 runs 4 bench rails against 4 fi_rma_bw pairs at once
# (their sum).
#
# fi_rma_bw runs twice per size:
# - `-j 0`, every write posted with a completion that reports delivery (`-U`:
#   FI_DELIVERY_COMPLETE), which is what a write of the backend completes on. The ratio is
#   against this one: the same work per write.
# - its default, which at sizes up to the provider's inject size (4 KiB for shm) posts
#   `fi_inject_writedata`: no completion at all, so nothing waits for the target; shm
#   carries a write of up to about 200 bytes inside its command. Printed for reference
#   ("inject"): no write of the backend can complete before it has landed.
#
#   bash scripts/efa-small.sh LF_PREFIX [SIZE ...]     # default sizes: 64 1024 4096
#   LF_PREFIX: libfabric 2.x with fabtests (bin/fi_rma_bw), e.g. from
#   `scripts/libfabric-2.6.sh --cuda CUDA_DIR`; XFER=target/release/xfer RUNS=3 RAILS=1
#   PROVIDER=shm
#
# Prints every run, then per size the medians (M writes/s) and the ratios.
set -euo pipefail
LF=$(cd "${1:?usage: efa-small.sh LF_PREFIX [SIZE ...]}" && pwd)
shift
(($# > 0)) || set -- 64 1024 4096
X=$(realpath "${XFER:-target/release/xfer}")
RUNS=${RUNS:-3}
RAILS=${RAILS:-1}
PROVIDER=${PROVIDER:-shm}
read -r -a shape <<<"${SHAPE:---depth $((4 * RAILS)) --pages 16}"
export XFER_LIBFABRIC=$LF/lib/libfabric.so.1
export FI_PROVIDER_PATH=$LF/lib/libfabric
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"

# fi_rma_bw: RAILS pairs at once, each on its own port; prints their summed M writes/s.
rma_bw() { # size [extra fi_rma_bw option ...]
    local size=$1 pids=() i port
    shift
    for i in $(seq "$RAILS"); do
        port=$((9300 + RANDOM % 500 + 600 * i))
        env LD_LIBRARY_PATH="$LF/lib" timeout 60 "$LF/bin/fi_rma_bw" -p "$PROVIDER" -E"$port" -U -o writedata \
            -S "$size" -W 64 -I 300000 "$@" >/dev/null 2>&1 &
        pids+=($!)
        sleep 0.3
        env LD_LIBRARY_PATH="$LF/lib" timeout 60 "$LF/bin/fi_rma_bw" -p "$PROVIDER" -E"$port" -U -o writedata \
            -S "$size" -W 64 -I 300000 "$@" 127.0.0.1 >"fi$i.out" 2>&1 &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || true; done
    # The result row: bytes, iters, total, time, MB/sec, usec/xfer, Mxfers/sec.
    cat fi*.out | awk '$1 ~ /^[0-9]+[kmg]?$/ && NF == 7 && $7 ~ /^[0-9.]+$/ {s += $7} END {printf "%.3f\n", s}'
    rm -f fi*.out
}

# xfer bench against xfer serve: prints M writes/s, or fails.
bench() { # size
    local size=$1 port=$((7500 + RANDOM % 400)) json
    timeout 120 "$X" serve --transport efa --provider "$PROVIDER" --listen 127.0.0.1:$port \
        --rails "$RAILS" --region-size 4MiB >serve.log 2>&1 &
    local srv=$!
    for _ in $(seq 100); do grep -q "xfer bench" serve.log && break; sleep 0.1; done
    json=$(timeout 120 "$X" bench --peer xfer://127.0.0.1:$port --transport efa --provider "$PROVIDER" \
        --rails "$RAILS" --region-size 4MiB --page-size "$size" "${shape[@]}" \
        --bytes $((size * 4000000)) --json 2>bench.err) || {
        kill $srv 2>/dev/null; cat bench.err serve.log >&2; return 1; }
    kill $srv 2>/dev/null; wait $srv 2>/dev/null || true
    python3 -c 'import json,sys; d=json.loads(sys.argv[1]); assert d["verified"], d; print(round(d["mops"],3))' "$json"
}

echo "== efa over $PROVIDER, two processes, host memory, $RAILS rail(s) (${shape[*]}), $(nproc) cores, $RUNS runs"
declare -A fd fj us
for run in $(seq "$RUNS"); do
    for size in "$@"; do
        d=$(rma_bw "$size" -j 0)
        j=$(rma_bw "$size")
        u=$(bench "$size")
        echo "$size B run $run: fi_rma_bw $d M/s (inject: $j), xfer $u M/s"
        fd[$size]+="$d "
        fj[$size]+="$j "
        us[$size]+="$u "
    done
done
for size in "$@"; do
    python3 - "$size" "${fd[$size]}" "${fj[$size]}" "${us[$size]}" <<'PY'
import statistics, sys
size = sys.argv[1]
d, j, u = (statistics.median(map(float, a.split())) for a in sys.argv[2:5])
ratio = lambda a, b: f"{a / b:.2f}" if b else "n/a"
print(f"{size} B: median fi_rma_bw {d:.2f} M/s, xfer {u:.2f} M/s, ratio {ratio(u, d)}"
      f" (fi_rma_bw inject {j:.2f} M/s, ratio {ratio(u, j)})")
PY
done
