# shellcheck shell=bash
# Shared by gpu-proof.sh and ipc-proof.sh (sourced; runs nothing): a step that is counted,
# the hardware test runner, and the closing verdict. Every failure is kept, the next steps
# still run, and `proof_verdict` exits non-zero when any step failed.

proof_failed=()
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
export XFER_REQUIRE_CUDA=1 XFER_REQUIRE_GPUS=$((ngpu > 1 ? 2 : 1))

# Runs one step; its whole output is shown, and a non-zero exit is recorded.
step() {
    local name=$1
    shift
    echo "== $name: $*"
    if "$@"; then echo "== $name: ok"; else echo "== $name: FAILED ($?)"; proof_failed+=("$name"); fi
}

# Runs a hardware test executable with its ignored (hardware) tests included; on a machine
# with one GPU the two-GPU tests (named two_gpus_*) are left out and counted as such.
hw_tests() {
    local exe=$1
    shift
    local skip=()
    ((ngpu >= 2)) || skip=(--skip two_gpus)
    step "tests ${exe#./}" "$exe" --include-ignored --test-threads=1 "${skip[@]}" "$@"
}

# The machine, for the log.
proof_machine() {
    echo "== machine: $(nproc) cores, $ngpu GPU(s), kernel $(uname -r)"
    nvidia-smi -L || true
}

# Exits 1 naming every failed step, 0 when all passed.
proof_verdict() {
    if ((${#proof_failed[@]} > 0)); then
        echo "FAILED steps (${#proof_failed[@]}): ${proof_failed[*]}" >&2
        exit 1
    fi
    echo "all steps passed"
}
