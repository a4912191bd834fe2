#!/usr/bin/env bash
# Builds libfabric 2.6.0 from third_party/libfabric (the source tarball vendored in this
# repository, checked against its SHA256SUMS first) into target/libfabric-2.6 once, for
# testing transport-efa against the 2.x generation as well as the system's (Debian 12:
# 1.17). Host memory only: no CUDA, no fabtests, no efa/verbs.
# Prints the library's path on stdout; everything else goes to stderr.
#
#   scripts/libfabric-2.6.sh            # -> target/libfabric-2.6/lib/libfabric.so.1
#   XFER_LIBFABRIC=$(scripts/libfabric-2.6.sh) cargo test -p transport-efa
#
# The build is skipped when the prefix already holds a library built from the same tarball.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
vendor=third_party/libfabric
tarball=$vendor/libfabric-2.6.0.tar.gz
prefix=$PWD/target/libfabric-2.6
lib=$prefix/lib/libfabric.so.1
[[ -f $tarball ]] || { echo "libfabric-2.6: $tarball not found (it is part of the repository)" >&2; exit 1; }
# The tarball must be the one SHA256SUMS names, byte for byte: a truncated or replaced copy
# (a Git LFS pointer, say) stops here with both sums, not somewhere in configure.
want=$(awk -v f="${tarball##*/}" '$2 == f || $2 == "*" f { print $1 }' "$vendor/SHA256SUMS")
got=$(sha256sum "$tarball" | cut -d' ' -f1)
if [[ -z $want || $got != "$want" ]]; then
    echo "libfabric-2.6: $tarball does not match $vendor/SHA256SUMS" >&2
    echo "  expected ${want:-(no line for ${tarball##*/})}" >&2
    echo "  got      $got" >&2
    exit 1
fi
# What the prefix was built from: the first 16 hex digits of the tarball's hash.
stamp=${got:0:16}
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
