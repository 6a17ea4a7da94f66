#!/usr/bin/env bash
# One command for the GPU machine (torch with CUDA + nvcc; no MXNet needed), < 5 minutes on an H200:
#   1. build the framework-free harness (tests/gpu/build.sh -> build/gpu/libgn_harness.so: the CMake
#      target gn_harness with GNMX_MXNET=OFF, or one nvcc command when cmake is missing)
#   2. run the GPU correctness tests (tests/gpu, vs float64 references and torch)
#   3. benchmark against torch's GroupNorm with the measured copy bandwidth as the bound
# Results: benchmarks/results/gpu_tests.md, gpu_bench.json, gpu_bench.md (or $GNMX_RESULTS).
#   bash benchmarks/gpu/run_all.sh [--quick]
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
RES="${GNMX_RESULTS:-$ROOT/benchmarks/results}"
mkdir -p "$RES"
t0=$(date +%s)

echo "== build" >&2
if command -v "${NVCC:-nvcc}" >/dev/null 2>&1 || [[ -x /usr/local/cuda/bin/nvcc ]]; then
  command -v "${NVCC:-nvcc}" >/dev/null 2>&1 || export NVCC=/usr/local/cuda/bin/nvcc
  if ! timeout 240 bash tests/gpu/build.sh; then
    echo "run_all.sh: harness build failed" >&2
    exit 1
  fi
elif [[ -f build/gpu/libgn_harness.so ]]; then
  echo "run_all.sh: no nvcc here; using the prebuilt build/gpu/libgn_harness.so" >&2
else
  echo "run_all.sh: no nvcc and no prebuilt build/gpu/libgn_harness.so" >&2
  exit 1
fi

echo "== tests" >&2
if "$PY" -c "import pytest" >/dev/null 2>&1; then
  # --confcutdir: tests/conftest.py imports mxnet, which the GPU machine does not have.
  timeout 180 "$PY" -m pytest --confcutdir=tests/gpu tests/gpu -q -rfEs -p no:cacheprovider \
    --maxfail=20 2>&1 | tee "$RES/gpu_tests.log"
  test_rc=${PIPESTATUS[0]}
else
  echo "run_all.sh: pytest is not importable by $PY: GPU tests NOT run (pip install pytest, or" \
       "set PYTHON=...); continuing with the benchmark" | tee "$RES/gpu_tests.log" >&2
  test_rc=3
fi
{
  echo "# gn_mx GPU harness tests"
  echo
  dev="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1 || true)"
  [[ -n "$dev" ]] || dev="$("$PY" -c 'import torch; print(torch.cuda.get_device_name())' 2>/dev/null || echo unknown)"
  echo "- device: ${dev}"
  echo "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ); pytest exit code: ${test_rc}"
  echo
  echo '```'
  tail -n 40 "$RES/gpu_tests.log"
  echo '```'
} >"$RES/gpu_tests.md"
rm -f "$RES/gpu_tests.log"

echo "== benchmark" >&2
timeout 180 "$PY" benchmarks/gpu/bench_gpu.py --out "$RES" "$@"
bench_rc=$?
echo "run_all.sh: tests rc=${test_rc}, bench rc=${bench_rc}, $(( $(date +%s) - t0 ))s" >&2
[[ $test_rc -eq 0 && $bench_rc -eq 0 ]]
