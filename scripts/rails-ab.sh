#!/usr/bin/env bash
# Same-call A/B of xfer binaries on one workload, runs interleaved, for comparisons of the
# rail scheduler (docs/benchmarks.md's 8-rail figures were taken this way on the H200):
#   scripts/rails-ab.sh REPS "NAME=BINARY [FLAGS...]" "NAME=BINARY [FLAGS...]" ... -- DEMO_ARGS...
# e.g. scripts/rails-ab.sh 5 "old=/tmp/xfer-71292e8" "new=target/release/xfer" \
#        -- --transport tcp --rails 8 --bytes 16GiB
# Prints one line per run (NAME, rep, Gbps), then each variant's median.
set -euo pipefail
reps=$1
shift
variants=()
while [[ $# -gt 0 && $1 != -- ]]; do
    variants+=("$1")
    shift
done
[[ ${1:-} == -- ]] && shift
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for rep in $(seq "$reps"); do
    for v in "${variants[@]}"; do
        name=${v%%=*}
        read -r -a cmd <<<"${v#*=}"
        "${cmd[0]}" demo "$@" "${cmd[@]:1}" --json >"$tmp/run.json" 2>"$tmp/run.err" ||
            { echo "$name rep$rep failed: $(tail -1 "$tmp/run.err")" >&2; continue; }
        g=$(python3 -c "import json,sys; print(round(json.load(open(sys.argv[1]))['gbps'], 1))" "$tmp/run.json")
        echo "$name rep$rep $g"
        echo "$g" >>"$tmp/$name"
    done
done
for v in "${variants[@]}"; do
    name=${v%%=*}
    [[ -f $tmp/$name ]] || continue
    echo "$name median $(sort -n "$tmp/$name" | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}') Gbps of $(wc -l <"$tmp/$name") runs"
done
