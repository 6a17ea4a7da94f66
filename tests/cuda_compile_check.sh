#!/usr/bin/env bash
# CI compile check for the CUDA code (no GPU needed, nothing is run):
#   1. libgn_mx.so configured and built with GNMX_CUDA=ON (every src/operator/kernels/*.cu, the
#      adapter with GNMX_WITH_CUDA and its "gpu" registrations), one architecture;
#   2. the framework-free GPU harness with tests/gpu/build.sh's nvcc-only fallback
#      (tests/test_cuda_compile.py builds the CMake target gn_harness itself).
# Prints "SKIPPED: ..." and exits 0 when no nvcc is installed.
#   bash tests/cuda_compile_check.sh          # env: NVCC, PYTHON, GNMX_CHECK_ARCH (80), GNMX_JOBS (2)
# Build trees live in build/cuda-check/ (incremental on reruns).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NVCC="${NVCC:-$(command -v nvcc || true)}"
if [[ -z "$NVCC" && -x /usr/local/cuda/bin/nvcc ]]; then NVCC=/usr/local/cuda/bin/nvcc; fi
if [[ -z "$NVCC" ]]; then
  echo "SKIPPED: nvcc not found (set NVCC=/path/to/nvcc to compile-check the CUDA sources)"
  exit 0
fi
PY="${PYTHON:-python3}"
ARCH="${GNMX_CHECK_ARCH:-80}"
JOBS="${GNMX_JOBS:-2}"
OUT="$ROOT/build/cuda-check"
MXNET_ROOT="$("$PY" -c 'import os, mxnet; print(os.path.dirname(mxnet.__file__))')"
echo "cuda_compile_check: $("$NVCC" --version | tail -n1), sm_${ARCH}"

cmake -S "$ROOT" -B "$OUT/lib" -DMXNET_ROOT="$MXNET_ROOT" -DGNMX_CUDA=ON \
  -DCMAKE_CUDA_COMPILER="$NVCC" -DCMAKE_CUDA_ARCHITECTURES="$ARCH" >"$OUT.cmake.log" 2>&1 \
  || { cat "$OUT.cmake.log"; exit 1; }
grep -q "CUDA kernels ON" "$OUT.cmake.log" || { cat "$OUT.cmake.log"; echo "CUDA not enabled"; exit 1; }
cmake --build "$OUT/lib" --target gn_mx -j "$JOBS"
# The gpu entry points must be in the library (not just compiled on the side).
nm -C "$OUT/lib/libgn_mx.so" >"$OUT.nm.txt"
grep -q "gn_mx::group_norm_fwd_cuda" "$OUT.nm.txt" || { echo "libgn_mx.so lacks the CUDA kernels"; exit 1; }

# The harness with build.sh's nvcc-only fallback (tests/test_cuda_compile.py builds its CMake target).
GNMX_HARNESS_NVCC_ONLY=1 GNMX_CUDA_ARCH="$ARCH" GNMX_HARNESS_OUT="$OUT/harness" NVCC="$NVCC" \
  bash "$ROOT/tests/gpu/build.sh"
echo "cuda_compile_check: OK"
