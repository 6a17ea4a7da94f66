#!/usr/bin/env bash
# One-stop set-up + run, for a fresh machine with Python 3.8-3.11 and a C++ compiler:
#   bash dev.sh demo            # venv + deps + build, then examples/quickstart.py
#   bash dev.sh test [ARGS]     # venv + deps + build, then pytest tests [ARGS]
# Environment: PYTHON (interpreter for the venv, default python3), GNMX_VENV (default .venv).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
cmd="${1:-}"
[ $# -gt 0 ] && shift

PY="${PYTHON:-python3}"
VENV="${GNMX_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[gn_mx] creating $VENV with $($PY --version 2>&1)"
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"

# Install requirements once per change of requirements-dev.txt.
stamp="$VENV/.gnmx-requirements"
if ! cmp -s requirements-dev.txt "$stamp" 2>/dev/null; then
  echo "[gn_mx] installing requirements-dev.txt"
  "$VPY" -m pip install -q --disable-pip-version-check -r requirements-dev.txt
  cp requirements-dev.txt "$stamp"
fi

# Build the op library against this venv's mxnet (CMake rebuilds incrementally).
echo "[gn_mx] building libgn_mx.so"
PATH="$VENV/bin:$PATH" "$VPY" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e .

case "$cmd" in
  demo) exec "$VPY" examples/quickstart.py "$@" ;;
  test) exec "$VPY" -m pytest tests -q -p no:cacheprovider "$@" ;;
  *) echo "usage: bash dev.sh demo|test [args]" >&2; exit 2 ;;
esac
