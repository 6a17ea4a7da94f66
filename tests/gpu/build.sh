#!/usr/bin/env bash
# Builds the framework-free GPU harness: the CUDA kernels listed in src/operator/kernels/cuda_sources.txt
# plus tests/gpu/harness.cc into build/gpu/libgn_harness.so (C ABI, loaded by tests/gpu/gnh.py with
# ctypes). No MXNet needed.
#
# With cmake (>= 3.18) this is the CMake target gn_harness, configured with -DGNMX_MXNET=OFF (no
# `import mxnet`) in $GNMX_HARNESS_OUT/cmake and built with $GNMX_JOBS (default: all cores) jobs.
# Without cmake, when its configure fails, or with GNMX_HARNESS_NVCC_ONLY=1, it says why and runs one
# nvcc command on the same source list with the same flags.
#
#   bash tests/gpu/build.sh            # arch: GNMX_CUDA_ARCH (e.g. 90), else the visible GPU's,
#                                      # else "80;90"; PTX of the highest arch is always embedded,
#                                      # so a newer GPU (or a missing nvidia-smi) still runs it
#   NVCC=/path/to/nvcc GNMX_CUDA_ARCH="80;90" bash tests/gpu/build.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
NVCC="${NVCC:-nvcc}"
if ! command -v "$NVCC" >/dev/null 2>&1; then
  echo "build.sh: nvcc not found (set NVCC=...)" >&2
  exit 2
fi
NVCC="$(command -v "$NVCC")"
ARCH="${GNMX_CUDA_ARCH:-}"
if [[ -z "$ARCH" ]] && command -v nvidia-smi >/dev/null 2>&1; then
  ARCH="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d ' .')"
fi
ARCH="${ARCH:-80;90}"
GENCODE=()
IFS=';, ' read -r -a ARCHS <<<"$ARCH"
top=0
for a in "${ARCHS[@]}"; do
  [[ "$a" =~ ^[0-9]+$ ]] || { echo "build.sh: bad architecture '$a' in '$ARCH'" >&2; exit 2; }
  GENCODE+=(-gencode "arch=compute_${a},code=sm_${a}")
  (( a > top )) && top=$a
done
(( top > 0 )) || { echo "build.sh: no architecture in '$ARCH'" >&2; exit 2; }
GENCODE+=(-gencode "arch=compute_${top},code=compute_${top}")  # PTX: JIT-compiled on newer GPUs
OUT="${GNMX_HARNESS_OUT:-$ROOT/build/gpu}"
mkdir -p "$OUT"

# cmake usable? (a pyenv shim or a broken install answers `command -v` but not --version)
CMAKE="${CMAKE:-cmake}"
why=""
if [[ "${GNMX_HARNESS_NVCC_ONLY:-}" == 1 ]]; then
  why="GNMX_HARNESS_NVCC_ONLY=1"
elif ! cmver="$("$CMAKE" --version 2>/dev/null | head -n1)" || [[ -z "$cmver" ]]; then
  why="cmake not found"
else
  v="${cmver##* }"; IFS=. read -r vmaj vmin _ <<<"$v"
  if ! [[ "$vmaj" =~ ^[0-9]+$ && "$vmin" =~ ^[0-9]+$ ]] || (( vmaj < 3 || (vmaj == 3 && vmin < 18) )); then
    why="cmake $v is older than 3.18"
  fi
fi

if [[ -z "$why" ]]; then
  BUILD="$OUT/cmake"
  JOBS="${GNMX_JOBS:-$(nproc 2>/dev/null || echo 2)}"
  CMAKE_ARCHS="$(IFS=';'; echo "${ARCHS[*]}")"
  echo "build.sh: cmake target gn_harness, $NVCC arch=${ARCH} -> $OUT/libgn_harness.so" >&2
  mkdir -p "$BUILD"
  if "$CMAKE" -S "$ROOT" -B "$BUILD" -DGNMX_MXNET=OFF -DGNMX_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_CUDA_COMPILER="$NVCC" -DCMAKE_CUDA_ARCHITECTURES="$CMAKE_ARCHS" \
      -DCMAKE_EXPORT_COMPILE_COMMANDS=ON >"$BUILD/configure.log" 2>&1; then
    "$CMAKE" --build "$BUILD" --target gn_harness -j "$JOBS"
    cp "$BUILD/libgn_harness.so" "$OUT/libgn_harness.so.tmp"
  else
    # e.g. a cmake too old to identify this nvcc: report it, then build without cmake
    tail -n 30 "$BUILD/configure.log" >&2
    why="cmake configure failed (log: $BUILD/configure.log)"
  fi
fi
if [[ -n "$why" ]]; then
  LIST="$ROOT/src/operator/kernels/cuda_sources.txt"
  SRCS=()
  while IFS= read -r line || [[ -n "$line" ]]; do
    line="${line%%#*}"; line="${line//[[:space:]]/}"
    [[ -n "$line" ]] && SRCS+=("$ROOT/src/operator/kernels/$line")
  done <"$LIST"
  (( ${#SRCS[@]} > 0 )) || { echo "build.sh: no sources in $LIST" >&2; exit 2; }
  SRCS+=("$ROOT/tests/gpu/harness.cc")
  echo "build.sh: ${why}: one nvcc command on the sources in src/operator/kernels/cuda_sources.txt," \
       "$NVCC arch=${ARCH} -> $OUT/libgn_harness.so" >&2
  "$NVCC" -std=c++17 -O3 -shared -Xcompiler -fPIC,-fvisibility=hidden -DGNMX_WITH_CUDA \
    -I"$ROOT/src/operator" "${GENCODE[@]}" "${SRCS[@]}" -ldl -o "$OUT/libgn_harness.so.tmp"
fi
mv "$OUT/libgn_harness.so.tmp" "$OUT/libgn_harness.so"
