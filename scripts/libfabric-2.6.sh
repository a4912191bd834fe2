#!/usr/bin/env bash
# Builds libfabric 2.6.0 from ../shared/vendor (the project's vendored source) into
# target/libfabric-2.6 once, for testing transport-efa against the 2.x generation as well as
# the system's (Debian 12: 1.17). Host memory only: no CUDA, no fabtests, no efa/verbs
# (for GPU machines, ../shared/vendor/build-libfabric-cuda.sh builds the CUDA-enabled one).
# Prints the library's path on stdout; everything else goes to stderr.
#
#   scripts/libfabric-2.6.sh            # -> target/libfabric-2.6/lib/libfabric.so.1
#   XFER_LIBFABRIC=$(scripts/libfabric-2.6.sh) cargo test -p transport-efa
#
# The build is skipped when the prefix already holds a library built from the same tarball.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
tarball=../shared/vendor/libfabric-2.6.0.tar.gz
prefix=$PWD/target/libfabric-2.6
lib=$prefix/lib/libfabric.so.1
[[ -f $tarball ]] || { echo "libfabric-2.6: $tarball not found (../shared/vendor beside the checkout)" >&2; exit 1; }
stamp=$(sha256sum "$tarball" | cut -c1-16)
if [[ -f $lib && "$(cat "$prefix/.source" 2>/dev/null)" == "$stamp" ]]; then
    echo "$lib"
    exit 0
fi
for tool in cc make; do
    command -v "$tool" >/dev/null || { echo "libfabric-2.6: needs $tool (apt-get install gcc make)" >&2; exit 1; }
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
start=$SECONDS
tar -xzf "$tarball" -C "$work"
cd "$work"/libfabric-2.6.0
echo "==> building libfabric 2.6.0 into $prefix (about a minute on 2 cores)" >&2
./configure --prefix="$prefix" --disable-static --without-cuda \
    --enable-shm=yes --enable-tcp=yes --enable-sockets=yes --enable-rxm=yes --enable-udp=yes \
    --enable-efa=no --enable-verbs=no --disable-psm2 --disable-psm3 --disable-opx \
    --disable-usnic --disable-cxi --disable-ucx --disable-lpp >"$work/configure.log" 2>&1 ||
    { tail -20 "$work/configure.log" >&2; exit 1; }
make -j"$(nproc)" >"$work/make.log" 2>&1 || { tail -30 "$work/make.log" >&2; exit 1; }
rm -rf "$prefix"
make install >"$work/install.log" 2>&1 || { tail -20 "$work/install.log" >&2; exit 1; }
echo "$stamp" >"$prefix/.source"
echo "==> libfabric 2.6.0 built in $((SECONDS - start))s" >&2
echo "$lib"
