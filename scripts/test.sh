#!/usr/bin/env bash
# The whole test suite, as CI runs it (.ci/run): format, lints, docs, tests.
# Installs the system packages it needs on Debian/Ubuntu when run as root; otherwise
# says what to install. Under CI=true, libfabric and network-namespace tests fail instead
# of skipping.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/deps.sh
source scripts/deps.sh

xfer_install_deps
xfer_require_rust rustfmt clippy

# What this machine can run is required to run: libfabric's providers under CI (the
# packages above bring them), network namespaces under CI or as root. Tests that need
# hardware no CI machine has (a GPU, two GPUs, a CUDA-enabled libfabric) are #[ignore]d and
# counted as ignored in the summary; scripts/gpu-proof.sh and ipc-proof.sh run them.
if [[ "${CI:-}" == true ]]; then
    export XFER_REQUIRE_LIBFABRIC="${XFER_REQUIRE_LIBFABRIC:-1}"
    # The directory's tests start Debian's etcd (installed above) on loopback ports.
    export XFER_REQUIRE_ETCD="${XFER_REQUIRE_ETCD:-1}"
fi
if [[ "${CI:-}" == true || "$(id -u)" == 0 ]]; then
    export XFER_REQUIRE_NETNS="${XFER_REQUIRE_NETNS:-1}"
fi

failed=()
# Runs one check, timed; a failure is recorded and the next checks still run.
step() {
    local name=$1 start=$SECONDS
    shift
    echo "==> $name: $*"
    if "$@"; then
        echo "==> $name: ok ($((SECONDS - start))s)"
    else
        echo "==> $name: FAILED ($((SECONDS - start))s)"
        failed+=("$name")
    fi
}

# transport-efa against the other libfabric generation: 2.6, built from the tarball in
# third_party/libfabric (cached in target/), beside the system's 1.17 that the main test
# step uses. An API difference between the two shows up here before it does on p5. Where
# libfabric is required (CI), so is 2.x here (XFER_REQUIRE_LIBFABRIC_2): what only 2.x has
# (the native tcp endpoint) fails instead of skipping.
efa_on_libfabric_2_6() {
    local lib
    lib=$(scripts/libfabric-2.6.sh) || return 1
    XFER_LIBFABRIC="$lib" XFER_REQUIRE_LIBFABRIC_2="${XFER_REQUIRE_LIBFABRIC:-}" \
        cargo test -p libfabric-sys -p transport-efa --no-fail-fast
}

# The Python package (xfer-py): a venv under target/ with maturin, numpy and pytest from
# PyPI; the package built by pip through its pyproject.toml with cargo's dev profile (it
# shares the debug build of the workspace that cargo test uses: a release build would
# compile everything a second time), then its pytest suite. CUDA cases are reported as
# skipped here; scripts/py-gpu-proof.sh runs them on a GPU machine.
py_test() {
    local venv=target/pyvenv
    if [[ ! -x $venv/bin/python ]]; then
        python3 -m venv "$venv" || return 1
    fi
    "$venv/bin/pip" install -q --disable-pip-version-check maturin numpy pytest || return 1
    PATH="$PWD/$venv/bin:$PATH" "$venv/bin/pip" install -q --disable-pip-version-check \
        --force-reinstall --no-deps --no-build-isolation \
        --config-settings=build-args="--profile dev" ./xfer-py || return 1
    (cd xfer-py && "../$venv/bin/python" -m pytest -q -rs tests)
}

step fmt cargo fmt --all -- --check
step clippy cargo clippy --workspace --all-targets -- -D warnings
step doc env RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps
step efa-libfabric-2.6 efa_on_libfabric_2_6
step python py_test
# Last, so that cargo test's summary closes the output.
step test cargo test --workspace --no-fail-fast

if ((${#failed[@]} > 0)); then
    echo "error: failed checks: ${failed[*]}" >&2
    exit 1
fi
