#!/usr/bin/env bash
# The figures of docs/benchmarks.md, measured on the machine this runs on: each row one `xfer demo`
# command, run 3 times; prints a markdown table (median and min-max of each figure) headed
# by the commit and a description of the machine (cores, CPU, memory, GPUs, kernel).
#
#   scripts/bench.sh [--quick] [--only REGEX]
#     --quick      transfers 8 times smaller (a check that every row runs, not figures to quote)
#     --only RE    only the rows whose workload matches the extended regex RE
#
# The xfer binary: $XFER if set, else ./xfer beside this script (in the GPU kit, see
# scripts/gpu-kit.sh), else a release build of this checkout (cargo build --release).
# Rows that need what the machine lacks (a GPU, two GPUs, 16 cores) are left out and
# listed under the table. Every run must verify its bytes; a failed or unverified run
# fails its row, and the script then exits 1 after printing the table.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
quick=0 only=.
while (($#)); do
    case $1 in
    --quick) quick=1 ;;
    --only) only=$2; shift ;;
    -h | --help) sed -n '2,15s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "bench.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

if [[ -n "${XFER:-}" ]]; then
    X=$XFER
elif [[ -x "$here/xfer" ]]; then
    X=$here/xfer
else
    (cd "$here/.." && source scripts/deps.sh && xfer_install_deps && xfer_require_rust &&
        cargo build --release -q -p xfer-cli) >&2
    X=$here/../target/release/xfer
fi
if [[ -f "$here/COMMIT" ]]; then # in the GPU kit (scripts/gpu-kit.sh): what it was built from
    commit=$(cat "$here/COMMIT")
elif git -C "$here" rev-parse --short HEAD >/dev/null 2>&1; then
    commit=$(git -C "$here" rev-parse --short HEAD)
    git -C "$here/.." diff --quiet HEAD 2>/dev/null || commit="$commit (with uncommitted changes)"
else
    commit=unknown
fi

cores=$(nproc)
cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)
mem=$(awk '/^MemTotal/ { printf "%.0f GiB", $2 / 1048576 }' /proc/meminfo)
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || true)
ngpu=$(grep -c . <<<"$gpus" || true)
gpu_text=none
((ngpu == 0)) || gpu_text="$ngpu x $(head -n 1 <<<"$gpus")"

# Each row: workload | needs (any, gpu, 2gpu, 16cores) | xfer arguments (bytes last, as
# --bytes N: --quick divides N). Throughput rows report Gbps and, with --baseline, the
# ratios to that transport's baseline (the summary's baseline_kind); latency rows
# (--latency; --bytes sets how many transfers are timed) report the transfer's p50 and p99
# and the raw TCP ping-pong's p50 of the same run.
rows=(
    "TCP, 64 KiB pages, 1 rail, vs 1 raw stream|any|demo --transport tcp --baseline --json --bytes 8GiB"
    "TCP, 4 KiB pages, 1 rail, vs 1 raw stream|any|demo --transport tcp --page-size 4KiB --baseline --json --bytes 2GiB"
    "TCP, 64 KiB pages, 2 rails, vs 2 raw streams|any|demo --transport tcp --rails 2 --baseline --json --bytes 8GiB"
    "TCP, 64 KiB pages, 8 rails, vs 8 raw streams|16cores|demo --transport tcp --rails 8 --baseline --json --bytes 16GiB"
    "EFA backend over libfabric's tcp provider, 64 KiB pages|any|demo --transport efa --provider tcp --json --bytes 4GiB"
    "mem (in-process copies: the engine itself), 64 KiB pages, vs a memcpy of the same pages|any|demo --transport mem --baseline --json --bytes 8GiB"
    "latency: TCP, one 4 KiB page a transfer, depth 1|any|demo --latency --transport tcp --page-size 4KiB --pages 1 --json --bytes 80MiB"
    "latency: mem, one 4 KiB page a transfer, depth 1|any|demo --latency --transport mem --page-size 4KiB --pages 1 --json --bytes 80MiB"
    "latency: EFA backend over libfabric's tcp provider, one 4 KiB page, depth 1|any|demo --latency --transport efa --provider tcp --page-size 4KiB --pages 1 --json --bytes 80MiB"
    "TCP, GPU0 -> GPU0 memory, 64 KiB, 1 rail|gpu|demo --transport tcp --memory cuda --gpus 0 --rails 1 --pin off --json --bytes 16GiB"
    "TCP, GPU0 -> GPU0 memory, 64 KiB, 8 rails|gpu|demo --transport tcp --memory cuda --gpus 0 --rails 8 --pin off --json --bytes 16GiB"
    "cuda-ipc, GPU0 -> GPU0, one process, 64 KiB, 8 rails|gpu|demo --transport cuda-ipc --memory cuda --gpus 0 --rails 8 --pages 10000 --baseline --json --bytes 64GiB"
    "cuda-ipc, GPU0 -> GPU0, one process, 4 KiB, 8 rails|gpu|demo --transport cuda-ipc --memory cuda --gpus 0 --rails 8 --page-size 4KiB --pages 100000 --baseline --json --bytes 8GiB"
    "TCP, GPU0 -> GPU1 memory, 64 KiB, 8 rails|2gpu|demo --transport tcp --memory cuda --gpus 0,1 --rails 8 --json --bytes 16GiB"
    "cuda-ipc, GPU0 -> GPU1, one process, 64 KiB, 8 rails|2gpu|demo --transport cuda-ipc --memory cuda --gpus 0,1 --rails 8 --pages 10000 --baseline --json --bytes 128GiB"
)

# Median and range of the numbers on stdin: "M (LO-HI)", or "M" when all are equal.
stat() {
    sort -g | awk '{ v[NR] = $1 } END {
        if (NR == 0) { print "-"; exit }
        m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
        f = (m >= 100) ? "%.0f" : (m >= 10) ? "%.1f" : "%.2f"
        if (v[1] == v[NR]) printf f "\n", m
        else printf f " (" f "–" f ")\n", m, v[1], v[NR] }'
}
field() { grep -o "\"$1\":[0-9.eE+-]*" | head -n 1 | cut -d: -f2; }

table=() left=() failed=()
for row in "${rows[@]}"; do
    IFS='|' read -r what needs cmd <<<"$row"
    [[ "$what" =~ $only ]] || continue
    case $needs in
    gpu) ((ngpu >= 1)) || { left+=("$what (needs a GPU)"); continue; } ;;
    2gpu) ((ngpu >= 2)) || { left+=("$what (needs 2 GPUs)"); continue; } ;;
    16cores) ((cores >= 16)) || { left+=("$what (needs 16 cores)"); continue; } ;;
    esac
    if ((quick)); then
        bytes=${cmd##*--bytes }
        case $bytes in
        *GiB) cmd="${cmd% --bytes *} --bytes $((${bytes%GiB} * 128))MiB" ;;
        *MiB) cmd="${cmd% --bytes *} --bytes $((${bytes%MiB} * 128))KiB" ;;
        esac
    fi
    latency=0
    [[ " $cmd " == *" --latency "* ]] && latency=1
    a=() b=() c=() ok=1
    for run in 1 2 3; do
        echo "bench: [$run/3] xfer $cmd" >&2
        # shellcheck disable=SC2086 # the row's arguments are words
        if ! out=$("$X" $cmd 2>/dev/null) ||
            { ((!latency)) && ! grep -q '"verified":true' <<<"$out"; }; then
            echo "bench: FAILED: xfer $cmd" >&2
            ok=0
            break
        fi
        if ((latency)); then
            # The transfer's percentiles come first in the JSON; the raw ping-pong's object
            # is named.
            a+=("$(field p50_us <<<"$out")")
            b+=("$(field p99_us <<<"$out")")
            c+=("$(grep -o '"raw_tcp_round_trip":{[^}]*}' <<<"$out" | field p50_us)")
        else
            a+=("$(field gbps <<<"$out")")
            b+=("$(field ratio <<<"$out")")
            c+=("$(field ratio_hot <<<"$out")")
        fi
    done
    if ((!ok)); then
        failed+=("$what")
        table+=("| $what | \`xfer $cmd\` | FAILED |")
        continue
    fi
    if ((latency)); then
        result="p50 $(printf '%s\n' "${a[@]}" | stat) µs; p99 $(printf '%s\n' "${b[@]}" | stat) µs"
        r=$(printf '%s\n' "${c[@]}" | grep . | stat || true)
        [[ -z "$r" || "$r" == - ]] || result="$result; raw TCP ping-pong p50 $r µs"
    else
        result="$(printf '%s\n' "${a[@]}" | stat) Gbps"
        r=$(printf '%s\n' "${b[@]}" | grep . | stat || true)
        [[ -z "$r" || "$r" == - ]] || result="$result; ratio $r"
        h=$(printf '%s\n' "${c[@]}" | grep . | stat || true)
        [[ -z "$h" || "$h" == - ]] || result="$result; hot $h"
    fi
    table+=("| $what | \`xfer $cmd\` | $result |")
done

echo "Measured at commit $commit on $cores cores ($cpu), $mem, GPU: $gpu_text, Linux $(uname -r); $(date -u +%Y-%m-%d)."
echo "Each figure is the median of 3 runs (min–max); every throughput run verified every written byte.$( ((quick)) && echo ' --quick: transfers 8 times smaller than the docs/benchmarks.md rows.')"
echo
echo "| workload | command | result |"
echo "|---|---|---|"
printf '%s\n' "${table[@]}"
if ((${#left[@]})); then
    echo
    echo "Not run on this machine: $(printf '%s; ' "${left[@]}" | sed 's/; $//')."
fi
if ((${#failed[@]})); then
    echo "bench.sh: failed rows: ${failed[*]}" >&2
    exit 1
fi
