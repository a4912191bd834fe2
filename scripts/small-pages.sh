#!/usr/bin/env bash
# Small pages against raw sockets, in one call: for each workload (PAGE:RAILS), RUNS runs of
# `xfer demo --transport tcp --baseline` (host memory), each of which times the engine and
# then, in the same process, raw TCP streams (one per rail) moving the same page size as
# random pages, 16 per writev, placed by readv into the same pages of a region of the same
# size (`baseline_pages_gbps`), and the same streams moving the same bytes from and into
# contiguous buffers of the region's size (`baseline_gbps`: what the path carries when
# nothing is scattered, the ceiling for both). Prints every run, then per workload the
# medians of the engine's Gbps, the raw page streams' Gbps, their ratio (the floors' figure)
# and the engine's ratio to the contiguous streams.
#
#   scripts/small-pages.sh [PAGE:RAILS ...]     # default: 4KiB:1 4KiB:2 4KiB:8 64KiB:1 64KiB:8
#   XFER=target/release/xfer RUNS=3 BYTES_4K=4GiB BYTES_64K=16GiB (the defaults)
#   MIN="4KiB:8=0.85 64KiB:1=1.0"   # exit 1 when a workload's median ratio is below its floor
#   XFER_B=path/to/other/xfer       # A/B: every run of XFER is followed by the same run of
#                                   # XFER_B; medians per binary (floors apply to XFER)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
X=${XFER:-target/release/xfer}
B=${XFER_B:-}
RUNS=${RUNS:-3}
[[ -x $X ]] || { echo "no $X: cargo build --release -p xfer-cli (or set XFER)" >&2; exit 2; }
[[ -z $B || -x $B ]] || { echo "no $B (XFER_B)" >&2; exit 2; }
bins=("$X")
[[ -n $B ]] && bins+=("$B")
labels=(A B)
(($# > 0)) || set -- 4KiB:1 4KiB:2 4KiB:8 64KiB:1 64KiB:8
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# The commit each binary was built from (`--version`), not the checkout's.
version() { "$1" --version 2>/dev/null || echo "$1: version unknown"; }
echo "== $(version "$X"), $(nproc) cores, $(uname -r)"
[[ -n $B ]] && echo "== A: $X, B: $B ($(version "$B"))"
for run in $(seq "$RUNS"); do
    for wl in "$@"; do
        page=${wl%%:*} rails=${wl#*:}
        bytes=${BYTES_64K:-16GiB}
        [[ $page == 4KiB ]] && bytes=${BYTES_4K:-4GiB}
        for i in "${!bins[@]}"; do
            tag=${B:+ ${labels[$i]}}
            "${bins[$i]}" demo --transport tcp --page-size "$page" --rails "$rails" \
                --bytes "$bytes" --baseline --json >"$tmp/out.json" 2>"$tmp/err" ||
                { echo "$wl$tag run $run failed: $(tail -1 "$tmp/err")" >&2; exit 1; }
            python3 - "$tmp/out.json" "$wl$tag" "$run" "$tmp/$wl.$i" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
row = (d["gbps"], d["baseline_pages_gbps"], d["ratio_pages"], d["baseline_gbps"], d["ratio"])
print(f"{sys.argv[2]} run {sys.argv[3]}: xfer {row[0]:.2f} Gbps, raw pages {row[1]:.2f} Gbps, "
      f"ratio {row[2]:.3f}; raw contiguous {row[3]:.2f} Gbps, {row[4]:.3f} of it")
open(sys.argv[4], "a").write(" ".join(map(str, row)) + "\n")
PY
        done
    done
done
# The binaries' labels ("A B" in A/B mode, none for one binary), as the runs were tagged.
python3 - "$tmp" "${MIN:-}" "${B:+${labels[*]}}" "$@" <<'PY'
import statistics, sys
tmp, floors = sys.argv[1], dict(f.split("=") for f in sys.argv[2].split())
labels = sys.argv[3].split() or [""]
low = []
for wl in sys.argv[4:]:
    for i, label in enumerate(labels):
        rows = [list(map(float, l.split())) for l in open(f"{tmp}/{wl}.{i}")]
        med = [statistics.median(c) for c in zip(*rows)]
        floor = float(floors.get(wl, 0)) if i == 0 else 0.0
        flag = "" if med[2] >= floor else f"  BELOW {floor}"
        tag = f" {label}" if label else ""
        print(f"{wl}{tag}: median of {len(rows)}: xfer {med[0]:.2f} Gbps, raw pages {med[1]:.2f} Gbps, "
              f"ratio {med[2]:.3f}{flag}; raw contiguous {med[3]:.2f} Gbps, {med[4]:.3f} of it")
        if flag:
            low.append(wl)
sys.exit(1 if low else 0)
PY
