#!/usr/bin/env bash
# Build examples/deploy_c/predict.c against the installed mxnet wheel (its include/ and
# libmxnet.so). Usage: bash examples/deploy_c/build.sh [OUTPUT]  (default: ./predict)
# Environment: PYTHON (the interpreter whose mxnet to use; default python3), CC (default cc).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PYTHON:-python3}"
MX="$("$PY" -c 'import os, mxnet; print(os.path.dirname(mxnet.__file__))' 2>/dev/null | tail -1 || true)"
if [ -z "$MX" ] || [ ! -f "$MX/libmxnet.so" ]; then
  echo "build.sh: $PY cannot import mxnet (set PYTHON to the interpreter of the venv with mxnet)" >&2
  exit 1
fi
"${CC:-cc}" -std=c99 -O2 -Wall "$here/predict.c" -I"$MX/include" -L"$MX" -lmxnet \
  -Wl,-rpath,"$MX" -o "${1:-predict}"
echo "built ${1:-predict} against $MX"
