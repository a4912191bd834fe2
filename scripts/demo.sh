#!/usr/bin/env bash
# Builds xfer (release) and runs `xfer demo`: both ends in one process over loopback TCP,
# random 64 KiB pages written into the peer's memory and verified; prints the throughput.
# Extra arguments go to `xfer demo` (e.g. --page-size 4KiB --rails 2 --baseline --json).
# Installs the system packages it needs on Debian/Ubuntu when run as root; otherwise
# says what to install.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/deps.sh
source scripts/deps.sh

xfer_install_deps
# shellcheck disable=SC2119 # no components needed to build
xfer_require_rust

cargo build --release -p xfer-cli
exec ./target/release/xfer demo "$@"
