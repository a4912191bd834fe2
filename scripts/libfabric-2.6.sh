#!/usr/bin/env bash
# Builds libfabric 2.6.0 from third_party/libfabric (the source tarball vendored in this
# repository, checked against its SHA256SUMS first), once: the build is skipped when the
# prefix already holds a library built the same way from the same tarball. Prints the
# library's path on stdout; everything else goes to stderr.
#
#   scripts/libfabric-2.6.sh [--prefix DIR]                 # host memory only
#   scripts/libfabric-2.6.sh --cuda CUDA_DIR [--prefix DIR] # with CUDA, for GPU machines
#
# Without --cuda: into target/libfabric-2.6, for testing transport-efa against the 2.x
# generation as well as the system's (Debian 12: 1.17). Host memory only: no CUDA, no
# fabtests, no efa/verbs.
#
#   scripts/libfabric-2.6.sh            # -> target/libfabric-2.6/lib/libfabric.so.1
#   XFER_LIBFABRIC=$(scripts/libfabric-2.6.sh) cargo test -p transport-efa
#
# With --cuda CUDA_DIR: into target/libfabric-2.6-cuda, the libfabric that GPU memory
# through transport-efa (FI_HMEM) needs, which Debian's and Ubuntu's packages are not:
# - CUDA HMEM with --enable-cuda-dlopen: libcudart, libcuda and libnvidia-ml are dlopen()ed
#   at run time, so libfabric.so.1 links against libc only and building needs CUDA's
#   headers, no CUDA library and no GPU. Upstream dlopen()s only "libcudart.so", the
#   development symlink that a machine with the runtime alone lacks (CUDA HMEM is then
#   silently off); this build falls back to libcudart.so.13, then .12 (a two-line patch of
#   src/hmem_cuda.c and fabtests' copy of it, applied to the unpacked source).
# - efa and verbs as plugins (lib/libfabric/lib{efa,verbs}-fi.so, loaded only where
#   rdma-core's libraries are), when rdma-core's headers are here: infiniband/efadv.h for
#   efa, rdma/rdma_cma.h for verbs (apt-get install libibverbs-dev librdmacm-dev
#   libnl-3-dev libnl-route-3-dev). RDMA=0 leaves them out, RDMA=1 requires them. Built
#   against Debian 12's rdma-core the efa plugin lacks the features newer rdma-core has
#   (RDMA write, efadv_query_mr...): for production EFA, build on a host with the EFA
#   installer's rdma-core.
# - fabtests (fi_rma_bw, fi_rdm_pingpong -D cuda...), which scripts/efa-hmem-proof.sh and
#   efa-small.sh run beside xfer; FABTESTS=0 leaves them out.
# - stripped, libtool's .la files dropped, pkg-config's file relative to its own folder and
#   libfabric's licence as COPYING.libfabric: the prefix can be copied anywhere. There:
#     export LD_LIBRARY_PATH=PREFIX/lib FI_PROVIDER_PATH=PREFIX/lib/libfabric
#     export XFER_LIBFABRIC=PREFIX/lib/libfabric.so.1
# About 1.5 minutes on 2 cores, fabtests half a minute more.
#
# CUDA_DIR must hold include/cuda.h, include/cuda_runtime.h, include/crt/host_config.h and
# include/nvml.h: /usr/local/cuda on a machine with the CUDA toolkit (nvml.h comes with its
# cuda-nvml-dev component). Without a toolkit, PyPI's wheels have them (CUDA 13 here; for
# CUDA 12 the -cu12 packages, whose headers sit under nvidia/cuda_runtime/include and such):
#
#   mkdir -p /tmp/cudawheels && cd /tmp/cudawheels
#   pip download --no-deps nvidia-cuda-runtime nvidia-cuda-crt nvidia-nvml-dev
#   for w in *.whl; do unzip -o -q "$w" -d x; done
#   mkdir -p /tmp/cuda13 && cp -r x/nvidia/cu13/include /tmp/cuda13/
#   scripts/libfabric-2.6.sh --cuda /tmp/cuda13
#
# (nvidia-cuda-runtime has cuda.h and cuda_runtime.h, nvidia-cuda-crt the crt/ headers they
# include, nvidia-nvml-dev nvml.h.)
set -euo pipefail
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "${BASH_SOURCE[0]}"; }
cuda='' prefix=''
while (($#)); do
    case $1 in
    --cuda) cuda=${2:?--cuda needs a folder with CUDA headers under include/}; shift ;;
    --prefix) prefix=${2:?--prefix needs a folder}; shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "libfabric-2.6: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
# Both folders as given from where this was called, before moving to the checkout.
own_prefix=1
if [[ -n $prefix ]]; then
    prefix=$(realpath -m "$prefix")
    own_prefix=0
fi
if [[ -n $cuda ]]; then
    [[ -d $cuda ]] || { echo "libfabric-2.6: --cuda $cuda: no such folder" >&2; exit 1; }
    cuda=$(cd "$cuda" && pwd)
fi
cd "$(dirname "${BASH_SOURCE[0]}")/.."
vendor=third_party/libfabric
tarball=$vendor/libfabric-2.6.0.tar.gz
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

# What the prefix was built from, kept in PREFIX/.source: the first 16 hex digits of the
# tarball's hash, and for the CUDA build the headers' CUDA_VERSION and the optional parts.
stamp=${got:0:16}
configure=(
    --disable-static
    --enable-shm=yes --enable-tcp=yes --enable-sockets=yes --enable-rxm=yes --enable-udp=yes
    --disable-psm2 --disable-psm3 --disable-opx --disable-usnic --disable-cxi --disable-ucx
    --disable-lpp
)
if [[ -z $cuda ]]; then
    prefix=${prefix:-$PWD/target/libfabric-2.6}
    configure+=(--without-cuda --enable-efa=no --enable-verbs=no)
    fabtests=0
else
    prefix=${prefix:-$PWD/target/libfabric-2.6-cuda}
    for h in cuda.h cuda_runtime.h crt/host_config.h nvml.h; do
        [[ -f $cuda/include/$h ]] || {
            echo "libfabric-2.6: $cuda/include/$h not found (--help says where CUDA's headers come from)" >&2
            exit 1
        }
    done
    cuda_version=$(sed -n 's/^#define CUDA_VERSION \([0-9]*\).*/\1/p' "$cuda/include/cuda.h")
    # efa and verbs: auto (where their headers are), 0 or 1.
    rdma=${RDMA:-auto}
    efa=no verbs=no
    if [[ $rdma == 1 ]]; then
        efa=dl verbs=dl
    elif [[ $rdma == auto ]]; then
        [[ -f /usr/include/infiniband/efadv.h && -f /usr/include/infiniband/verbs.h ]] && efa=dl
        [[ -f /usr/include/rdma/rdma_cma.h && -f /usr/include/infiniband/verbs.h ]] && verbs=dl
    fi
    fabtests=${FABTESTS:-1}
    configure+=(--with-cuda="$cuda" --enable-cuda-dlopen --enable-efa="$efa" --enable-verbs="$verbs")
    stamp="$stamp cuda $cuda_version efa=$efa verbs=$verbs fabtests=$fabtests"
fi
lib=$prefix/lib/libfabric.so.1
if [[ -f $lib && "$(cat "$prefix/.source" 2>/dev/null)" == "$stamp" ]]; then
    echo "$lib"
    exit 0
fi
# The prefix is emptied before installing: a folder given with --prefix only when it is
# empty or one this script built, never someone's /usr/local.
if ((!own_prefix)) && [[ -d $prefix && ! -f $prefix/.source && -n "$(ls -A "$prefix")" ]]; then
    echo "libfabric-2.6: --prefix $prefix holds files this script did not put there; give an empty or new folder" >&2
    exit 1
fi
for tool in cc make; do
    command -v "$tool" >/dev/null || { echo "libfabric-2.6: needs $tool (apt-get install gcc make)" >&2; exit 1; }
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
start=$SECONDS
tar -xzf "$tarball" -C "$work"
cd "$work"/libfabric-2.6.0

# CUDA: the libcudart fallback. Stops if upstream's line is not there to patch (a newer
# tarball may have changed it), rather than building a library that finds no runtime.
patch_cudart() { # FILE HANDLE: the variable that takes dlopen("libcudart.so")'s result
    local f=$1 h=$2
    grep -q 'libcudart\.so\.13' "$f" && return 0
    sed -i "s|^\([[:space:]]*\)${h//./\\.} = dlopen(\"libcudart\.so\", RTLD_NOW);|&\n\1if (!$h)\n\1\t$h = dlopen(\"libcudart.so.13\", RTLD_NOW);\n\1if (!$h)\n\1\t$h = dlopen(\"libcudart.so.12\", RTLD_NOW);|" "$f"
    grep -q 'dlopen("libcudart.so.13"' "$f" || { echo "libfabric-2.6: the libcudart patch did not apply to $f" >&2; exit 1; }
}
if [[ -n $cuda ]]; then
    patch_cudart src/hmem_cuda.c cuda_attr.runtime_handle
    patch_cudart fabtests/common/hmem_cuda.c cudart_handle
    echo "==> building libfabric 2.6.0 with CUDA $cuda_version headers from $cuda (efa: $efa, verbs: $verbs, fabtests: $fabtests) into $prefix" >&2
else
    echo "==> building libfabric 2.6.0 into $prefix (about a minute on 2 cores)" >&2
fi
./configure --prefix="$prefix" "${configure[@]}" >"$work/configure.log" 2>&1 ||
    { tail -20 "$work/configure.log" >&2; exit 1; }
if [[ -n $cuda ]]; then
    # configure turns CUDA off quietly when it cannot use the headers: say so instead.
    for d in HAVE_CUDA ENABLE_CUDA_DLOPEN; do
        grep -q "^#define $d 1" config.h || { echo "libfabric-2.6: configure left $d off (config.log says why)" >&2; exit 1; }
    done
    grep -E '^\*\*\* (Built-in|DSO) providers' "$work/configure.log" >&2 || true
fi
make -j"$(nproc)" >"$work/make.log" 2>&1 || { tail -30 "$work/make.log" >&2; exit 1; }
rm -rf "$prefix"
make install >"$work/install.log" 2>&1 || { tail -20 "$work/install.log" >&2; exit 1; }
if ((fabtests)); then
    cd fabtests
    ./configure --prefix="$prefix" --with-libfabric="$prefix" --with-cuda="$cuda" \
        >"$work/fabtests-configure.log" 2>&1 || { tail -20 "$work/fabtests-configure.log" >&2; exit 1; }
    make -j"$(nproc)" >"$work/fabtests-make.log" 2>&1 || { tail -30 "$work/fabtests-make.log" >&2; exit 1; }
    make install >"$work/fabtests-install.log" 2>&1 || { tail -20 "$work/fabtests-install.log" >&2; exit 1; }
    cd ..
fi
if [[ -n $cuda ]]; then
    # A prefix to copy to GPU machines: relocatable, small, with its licence.
    # shellcheck disable=SC2016 # ${pcfiledir} is pkg-config's, written as it is
    sed -i 's|^prefix=.*|prefix=${pcfiledir}/../..|' "$prefix/lib/pkgconfig/libfabric.pc"
    find "$prefix/lib" -name '*.la' -delete
    if command -v strip >/dev/null; then
        find "$prefix/bin" "$prefix/lib" -type f -print0 | while IFS= read -r -d '' f; do
            if [[ "$(head -c4 "$f" | tr -d '\0')" == $'\x7fELF' ]]; then strip --strip-unneeded "$f"; fi
        done
    fi
    cp COPYING "$prefix/COPYING.libfabric"
fi
echo "$stamp" >"$prefix/.source"
echo "==> libfabric 2.6.0 built in $((SECONDS - start))s" >&2
if [[ -n $cuda ]]; then
    echo "==> at run time: export LD_LIBRARY_PATH=$prefix/lib FI_PROVIDER_PATH=$prefix/lib/libfabric" >&2
fi
echo "$lib"
