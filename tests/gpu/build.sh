#!/usr/bin/env bash
# Builds the framework-free GPU harness: every src/operator/kernels/*_cuda.cu plus tests/gpu/harness.cc
# into build/gpu/libgn_harness.so (C ABI, loaded by tests/gpu/gnh.py with ctypes). No MXNet needed.
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
shopt -s nullglob
SRCS=("$ROOT"/src/operator/kernels/*_cuda.cu "$ROOT"/tests/gpu/harness.cc)
echo "build.sh: $NVCC arch=${ARCH} -> $OUT/libgn_harness.so" >&2
"$NVCC" -std=c++17 -O3 -shared -Xcompiler -fPIC,-fvisibility=hidden -DGNMX_WITH_CUDA \
  -I"$ROOT/src/operator" "${GENCODE[@]}" "${SRCS[@]}" -o "$OUT/libgn_harness.so.tmp"
mv "$OUT/libgn_harness.so.tmp" "$OUT/libgn_harness.so"
