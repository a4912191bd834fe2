#!/usr/bin/env bash
# What hostile clients cost a legitimate bench against `xfer serve`: runs the test
# xfer-cli/tests/hostile_serve.rs (a bench alone twice, then twice beside slow-loris,
# silent, flooding and oversized clients; ratio = best bench beside them over best alone)
# in a release build, 3 times, with XFER_ASSERT_HOSTILE_RATIO=1, so that each run also
# asserts its own ratio. Prints each run's ratio and figures and the median, headed by the
# commit and the machine; exits 1 when the median is below 0.8 or any run failed (a ratio
# below 0.8, or any of the test's correctness checks).
#
#   scripts/hostile-ratio.sh [RUNS]     # RUNS: 3 by default
#
# Run it on a quiet machine: the bench, the server and the hostile threads share its cores.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
runs=${1:-3}
min=0.8
test=hostile_clients_are_refused_with_reasons_while_a_bench_runs
[[ $runs =~ ^[1-9][0-9]*$ ]] || { echo "hostile-ratio.sh: RUNS must be a positive count, not $runs" >&2; exit 2; }

commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
git diff --quiet HEAD 2>/dev/null || commit="$commit (with uncommitted changes)"
cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)
echo "hostile_serve ratio at commit $commit on $(nproc) cores (${cpu:-unknown CPU}), $(uname -r); $(date +%F)"

echo "==> building the test in release" >&2
cargo test --release -q -p xfer-cli --test hostile_serve --no-run >&2

log=$(mktemp)
trap 'rm -f "$log"' EXIT
ratios=()
failed=0
for ((i = 1; i <= runs; i++)); do
    status=ok
    XFER_ASSERT_HOSTILE_RATIO=1 cargo test --release -q -p xfer-cli --test hostile_serve -- \
        --exact "$test" --nocapture >"$log" 2>&1 || status=FAILED
    # The test prints: legitimate bench alone: [..] Gbps; beside the hostiles: [..] Gbps;
    # ratio of the best runs R
    figures=$(grep -o 'legitimate bench alone: .*' "$log" | tail -n 1 || true)
    ratio=$(sed -n 's/.*ratio of the best runs \([0-9.]*\).*/\1/p' "$log" | tail -n 1)
    echo "run $i: ratio ${ratio:-none} ($status): ${figures:-no figures printed}"
    if [[ $status == FAILED ]]; then
        failed=$((failed + 1))
        grep -E "panicked|assert" "$log" | head -n 5 | sed 's/^/    /'
    fi
    [[ -z $ratio ]] || ratios+=("$ratio")
done

if ((${#ratios[@]} == 0)); then
    echo "no run printed a ratio" >&2
    exit 1
fi
median=$(printf '%s\n' "${ratios[@]}" | sort -g |
    awk '{ r[NR] = $1 } END { if (NR % 2) print r[(NR + 1) / 2]; else printf "%.3f\n", (r[NR / 2] + r[NR / 2 + 1]) / 2 }')
echo "median ratio of ${#ratios[@]} runs: $median (at least $min asked); failed runs: $failed of $runs"
if awk -v m="$median" -v min="$min" 'BEGIN { exit !(m < min) }'; then
    echo "hostile-ratio: the median $median is below $min" >&2
    exit 1
fi
if ((failed > 0)); then
    echo "hostile-ratio: $failed of $runs runs failed" >&2
    exit 1
fi
