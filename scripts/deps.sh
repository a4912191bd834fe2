# shellcheck shell=bash
# What xfer needs to build and test, installed on Debian/Ubuntu when missing.
# Sourced by scripts/test.sh and scripts/demo.sh; defines functions and runs nothing.

# System packages: a C toolchain (Rust's linker; building libfabric 2.6 for the tests),
# libfabric (loaded at run time by transport-efa; the tests run against it, and fi_info),
# hwloc with udev (topology) and pkg-config to find it, lstopo, ip, tc and nft for the
# network-namespace fault tests (transport-tcp/tests/netns_faults.rs), and python3 with
# venv (the xfer-py package's test venv) and its development files (libpython, which
# `cargo test` links xfer-py's unit tests against; the extension module does not link it),
# protoc with protobuf's well-known .proto files (libprotobuf-dev: the directory crate's etcd
# client compiles etcd's .proto files, which import them, when it builds) and
# etcd (the directory's tests start a real one on loopback ports).
XFER_DEB_PACKAGES=(
    gcc libc6-dev make
    libfabric1 libfabric-bin
    pkg-config
    libhwloc-dev libudev-dev hwloc
    iproute2 nftables
    python3 python3-venv python3-dev
    protobuf-compiler libprotobuf-dev etcd-server
)

# Prints the Debian packages of XFER_DEB_PACKAGES that are not installed, one a line.
xfer_missing_packages() {
    local p
    for p in "${XFER_DEB_PACKAGES[@]}"; do
        if [[ "$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null)" != installed ]]; then
            echo "$p"
        fi
    done
}

# Installs the missing system packages (as root, with apt-get), or says exactly what to
# install and returns 1 (not root, or not Debian/Ubuntu with the libraries missing).
xfer_install_deps() {
    if ! command -v dpkg-query >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1; then
        # Not Debian/Ubuntu: go on if pkg-config finds the libraries, else say what is needed.
        if command -v pkg-config >/dev/null 2>&1 && command -v cc >/dev/null 2>&1 &&
            pkg-config --exists hwloc libudev 2>/dev/null; then
            return 0
        fi
        echo "error: not a Debian/Ubuntu system and the build dependencies are not all found." >&2
        echo "Install: a C compiler and make, hwloc (>= 2.8, with headers), libudev (headers)," >&2
        echo "pkg-config; libfabric (>= 1.17) to run --transport efa and its tests." >&2
        return 1
    fi
    local missing
    mapfile -t missing < <(xfer_missing_packages)
    if ((${#missing[@]} == 0)); then
        return 0
    fi
    if [[ "$(id -u)" != 0 ]]; then
        echo "error: missing system packages: ${missing[*]}" >&2
        echo "Install them with:" >&2
        echo "    sudo apt-get update && sudo apt-get install -y ${missing[*]}" >&2
        return 1
    fi
    echo "==> installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends "${missing[@]}"
}

# Checks for cargo (and the given rustup components, e.g. rustfmt clippy); says what to
# install and returns 1 when something is missing. Rust >= 1.88 is needed.
xfer_require_rust() {
    if ! command -v cargo >/dev/null 2>&1 && [[ -x "${CARGO_HOME:-$HOME/.cargo}/bin/cargo" ]]; then
        export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"
    fi
    if ! command -v cargo >/dev/null 2>&1; then
        echo "error: cargo not found: install Rust >= 1.88 (https://rustup.rs)." >&2
        return 1
    fi
    local c missing=()
    for c in "$@"; do
        case "$c" in
        rustfmt) cargo fmt --version >/dev/null 2>&1 || missing+=(rustfmt) ;;
        clippy) cargo clippy --version >/dev/null 2>&1 || missing+=(clippy) ;;
        *) echo "xfer_require_rust: unknown component $c" >&2; return 1 ;;
        esac
    done
    if ((${#missing[@]} > 0)); then
        echo "error: missing Rust components: ${missing[*]}" >&2
        echo "Install them with:" >&2
        echo "    rustup component add ${missing[*]}" >&2
        return 1
    fi
}
