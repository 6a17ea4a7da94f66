#!/usr/bin/env bash
# A private CUDA 11.8 toolkit for building gn_mx for mxnet-cu112 users (drivers >= 450.80), fetched
# from Debian bookworm's non-free packages WITHOUT installing them: a private apt configuration
# (its own sources list, lists, cache and an empty dpkg status) downloads the .debs, `dpkg -x`
# unpacks them into a staging folder and the CUDA home is assembled from it, with its own
# nvcc.profile. Nothing system-wide changes, except that the host compiler CUDA 11.8 accepts
# (gcc-11/g++-11, bookworm main) is apt-get installed when missing. Never `apt-get install` the
# toolkit itself: it pulls libcuda1, a driver's user-space libraries.
#
#   bash tools/cuda11_toolchain.sh            # fetch (once) + check; prints the CUDA home on stdout
#   bash tools/cuda11_toolchain.sh --cmake-args   # prints the CMake arguments for that toolkit
#   bash tools/cuda11_toolchain.sh --check    # exit 0 when the cached toolkit is complete, 1 if not
#
# Environment: GNMX_TOOLCHAIN_DIR (cache, default <repo>/.toolchains, git-ignored).
# Result: $GNMX_TOOLCHAIN_DIR/cuda-11.8/{bin,nvvm,include,lib64}; the download (~860 MB of .debs)
# is deleted once the home is assembled (~2.3 GB unpacked, of which the home keeps what nvcc needs).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOP="${GNMX_TOOLCHAIN_DIR:-$REPO/.toolchains}"
H="$TOP/cuda-11.8"
PKGS=(nvidia-cuda-toolkit libnvvm4 libcudart11.0 nvidia-cuda-dev)
WANT_VERSION="11.8"
HOST_CXX=g++-11
HOST_CC=gcc-11

log() { echo "[cuda11] $*" >&2; }

complete() {
  [ -x "$H/bin/nvcc" ] && [ -x "$H/nvvm/bin/cicc" ] && [ -f "$H/lib64/libcudart_static.a" ] &&
    [ -f "$H/lib64/libcudadevrt.a" ] && [ -f "$H/include/cuda_runtime.h" ] &&
    "$H/bin/nvcc" --version 2>/dev/null | grep -q "release $WANT_VERSION"
}

cmake_args() {
  echo "-DCMAKE_CUDA_COMPILER=$H/bin/nvcc -DCUDAToolkit_ROOT=$H -DCMAKE_CUDA_HOST_COMPILER=$(command -v $HOST_CXX)"
}

case "${1:-}" in
  --check) complete; exit $? ;;
  --cmake-args) complete || { log "toolkit not fetched yet: run bash tools/cuda11_toolchain.sh"; exit 1; }
                cmake_args; exit 0 ;;
  "") ;;
  *) echo "usage: bash tools/cuda11_toolchain.sh [--check|--cmake-args]" >&2; exit 2 ;;
esac

# One fetch at a time (the test suite's background resource audit and the GPGPU-Sim layer may ask
# at once): the second waits here, then finds the toolkit complete.
mkdir -p "$TOP"
exec 9>"$TOP/.lock"
if command -v flock >/dev/null; then flock 9; fi

# Host compiler: CUDA 11.8 rejects gcc > 11.
if ! command -v $HOST_CXX >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    log "installing $HOST_CC/$HOST_CXX (bookworm main; CUDA 11.8 rejects gcc 12)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$HOST_CC" "$HOST_CXX" >&2 ||
      { apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$HOST_CC" "$HOST_CXX" >&2; }
  else
    log "CUDA 11.8 needs $HOST_CXX as its host compiler: apt-get install $HOST_CC $HOST_CXX"; exit 1
  fi
fi

if complete; then
  log "cached: $H ($("$H/bin/nvcc" --version | grep -o 'release [0-9.]*'))"
  echo "$H"; exit 0
fi

command -v apt-get >/dev/null && command -v dpkg >/dev/null ||
  { log "needs a Debian/Ubuntu host (apt-get, dpkg) to fetch Debian's nvidia-cuda-toolkit"; exit 1; }

# Private apt configuration: the machine's own Debian mirror (from its deb822 or one-line
# sources), suite bookworm, with contrib + non-free added.
A="$TOP/apt"
mkdir -p "$A/lists/partial" "$A/cache/archives/partial" "$A/etc/preferences.d"
: > "$A/status"
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
mirror=$(bash "$REPO/tools/debian_mirror.sh")
echo "deb [signed-by=$keyring] $mirror bookworm main contrib non-free" > "$A/sources.list"
APT=(apt-get -q -o "Dir::Etc::SourceList=$A/sources.list" -o Dir::Etc::SourceParts=/nonexistent
     -o "Dir::Etc::Preferences=$A/etc/preferences" -o "Dir::Etc::PreferencesParts=$A/etc/preferences.d"
     -o "Dir::State::Lists=$A/lists" -o "Dir::Cache=$A/cache" -o "Dir::State::status=$A/status"
     -o APT::Sandbox::User=root -o Debug::NoLocking=1)
if ! ls "$TOP/debs/"*.deb >/dev/null 2>&1 || [ "$(ls "$TOP/debs/"*.deb | wc -l)" -lt ${#PKGS[@]} ]; then
log "apt (private, $mirror bookworm main contrib non-free): update"
"${APT[@]}" update >&2
D="$TOP/debs"; mkdir -p "$D"
log "downloading ${PKGS[*]} (~860 MB)"
(cd "$D" && "${APT[@]}" download "${PKGS[@]}" >&2)
fi
D="$TOP/debs"

S="$TOP/stage"; rm -rf "$S"; mkdir -p "$S"
for deb in "$D"/*.deb; do log "unpacking $(basename "$deb")"; dpkg -x "$deb" "$S"; done

# Assemble the CUDA home from Debian's layout (/usr/lib/nvidia-cuda-toolkit/{bin,libdevice},
# /usr/lib/x86_64-linux-gnu/*, /usr/include/*).
rm -rf "$H"; mkdir -p "$H/bin" "$H/nvvm/bin" "$H/nvvm/lib64" "$H/nvvm/libdevice" "$H/include" "$H/lib64/stubs"
NT="$S/usr/lib/nvidia-cuda-toolkit"
for b in nvcc ptxas fatbinary nvlink cudafe++ bin2c cuobjdump nvprune nvdisasm cicc; do
  src=""
  for c in "$NT/bin/$b" "$S/usr/bin/$b"; do   # the ELF binary, not Debian's /usr/bin wrapper scripts
    if [ -f "$c" ] && [ "$(head -c4 "$c")" = $'\x7fELF' ]; then src="$c"; break; fi
  done
  if [ -z "$src" ]; then
    case "$b" in nvprune|nvdisasm) continue ;; esac
    log "missing $b in the unpacked packages"; exit 1
  fi
  if [ "$b" = cicc ]; then cp -L "$src" "$H/nvvm/bin/cicc"; else cp -L "$src" "$H/bin/$b"; fi
done
[ -d "$NT/bin/crt" ] && cp -a "$NT/bin/crt" "$H/bin/crt"
ld=$(find "$S" -type f -name 'libdevice.10.bc' | head -1)
[ -n "$ld" ] || { log "missing libdevice.10.bc"; exit 1; }
cp -a "$ld" "$H/nvvm/libdevice/"
cp -a "$S"/usr/lib/x86_64-linux-gnu/libnvvm.so* "$H/nvvm/lib64/"
ln -sf ../nvvm/lib64 "$H/nvvm/lib" 2>/dev/null || true
# Headers: Debian puts CUDA's headers straight into /usr/include (plus crt/, thrust/, cub/, ...).
cp -a "$S/usr/include/." "$H/include/"
for l in libcudart_static.a libcudadevrt.a libculibos.a; do
  f=$(find "$S" -name "$l" | head -1); [ -n "$f" ] && cp -a "$f" "$H/lib64/"
done
f=$(find "$S" -path '*stubs*' -name 'libcuda.so' | head -1); [ -n "$f" ] && cp -a "$f" "$H/lib64/stubs/"
cp -a "$S"/usr/lib/x86_64-linux-gnu/libcudart.so* "$H/lib64/" 2>/dev/null || true
# nvcc.profile: Debian's hard-codes /usr/lib/nvidia-cuda-toolkit; ours is relative to bin/.
cat > "$H/bin/nvcc.profile" <<'EOF'
TOP = $(_HERE_)/..
NVVMIR_LIBRARY_DIR = $(TOP)/nvvm/libdevice
LD_LIBRARY_PATH += $(TOP)/nvvm/lib64:
PATH += $(TOP)/nvvm/bin:$(_HERE_):
INCLUDES += "-I$(TOP)/include" $(_SPACE_)
LIBRARIES =+ $(_SPACE_) "-L$(TOP)/lib64/stubs" "-L$(TOP)/lib64"
CUDAFE_FLAGS +=
PTXAS_FLAGS +=
EOF
echo "11.8.89 (Debian bookworm non-free: ${PKGS[*]})" > "$H/version.txt"
rm -rf "$S" "$D" "$A"

complete || { log "the assembled toolkit at $H is incomplete"; exit 1; }
# Smoke test: one kernel through the whole nvcc pipeline with the host compiler.
t=$(mktemp -d)
printf '__global__ void k(float* x){x[threadIdx.x]*=2.f;}\nint main(){float* p; cudaMalloc(&p,4); k<<<1,1>>>(p); return 0;}\n' > "$t/t.cu"
"$H/bin/nvcc" -ccbin "$HOST_CXX" -gencode arch=compute_52,code=sm_52 -cudart static -o "$t/t" "$t/t.cu" >&2 ||
  { log "smoke compile failed"; rm -rf "$t"; exit 1; }
rm -rf "$t"
log "ready: $H ($(du -sh "$H" | cut -f1))"
echo "$H"
