#!/usr/bin/env bash
# One-stop set-up + run, for a fresh machine with Python 3.8-3.11 and a C++ compiler:
#   bash dev.sh demo            # venv + deps + build, then examples/quickstart.py
#   bash dev.sh test [ARGS]     # venv + deps + build, then pytest tests [ARGS] (pytest ARGS alone
#                               # when ARGS name test files/folders)
# Environment: PYTHON (interpreter for the venv, default python3), GNMX_VENV (default .venv),
#   GNMX_HOROVOD=1 (also build Horovod, requirements-horovod.txt; CI sets it).
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
# From here on "the interpreter" is the venv's, for every script the suite or the demo starts that
# reads PYTHON (examples/deploy_c/build.sh, tools/build_wheel.sh, tests/gpu/sim/gpgpusim.sh): a
# PYTHON=<3.x> given to choose the venv's interpreter must not leak into them.
PYTHON="$(cd "$(dirname "$VPY")" && pwd)/python"
export PYTHON

# Install requirements once per change of them: the demo needs only requirements-demo.txt (MXNet,
# numpy, build tools); the tests requirements-dev.txt (which includes it).
req=requirements-dev.txt
stamp="$VENV/.gnmx-requirements"
if [ "$cmd" = demo ]; then
  req=requirements-demo.txt
  stamp="$VENV/.gnmx-requirements-demo"
fi
if ! cat "$req" requirements-demo.txt | cmp -s - "$stamp" 2>/dev/null; then
  echo "[gn_mx] installing $req"
  "$VPY" -m pip install -q --disable-pip-version-check -r "$req"
  cat "$req" requirements-demo.txt > "$stamp"
fi

# --- Horovod (optional; tests/test_horovod.py, examples/horovod_train.py) -------------------------
# GNMX_HOROVOD=1 (set by .ci/run) builds Horovod with MXNet + Gloo from source, once per change of
# requirements-horovod.txt (~4 min on 2 cores). Unset: nothing happens and the Horovod test skips.
if [ "${GNMX_HOROVOD:-0}" = 1 ]; then
  hstamp="$VENV/.gnmx-requirements-horovod"
  if ! cmp -s requirements-horovod.txt "$hstamp" 2>/dev/null; then
    echo "[gn_mx] building Horovod (requirements-horovod.txt; MXNet + Gloo, no MPI)"
    # --no-cache-dir: the HOROVOD_* choices are not part of pip's wheel-cache key.
    PATH="$VENV/bin:$PATH" HOROVOD_WITH_MXNET=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
      HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
      HOROVOD_CPU_OPERATIONS=GLOO CMAKE_POLICY_VERSION_MINIMUM=3.5 \
      MAKEFLAGS="${MAKEFLAGS:--j${GNMX_JOBS:-2}}" \
      "$VPY" -m pip install -q --disable-pip-version-check --no-build-isolation --no-cache-dir \
      -r requirements-horovod.txt
    cp requirements-horovod.txt "$hstamp"
  fi
fi
# ---------------------------------------------------------------------------------------------------

# Build the op library against this venv's mxnet (CMake rebuilds incrementally).
echo "[gn_mx] building libgn_mx.so"
PATH="$VENV/bin:$PATH" "$VPY" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e .

case "$cmd" in
  demo)
    echo "[gn_mx] the venv: $VENV (activate it with: source $VENV/bin/activate)"
    exec "$VPY" examples/quickstart.py "$@" ;;
  test)
    # Test paths given (bash dev.sh test tests/test_x.py -k y): just those; otherwise all of tests/.
    given=0
    for a in "$@"; do [ -e "$a" ] && given=1; done
    [ "$given" = 1 ] || set -- tests "$@"
    exec "$VPY" -m pytest -q -p no:cacheprovider "$@" ;;
  *) echo "usage: bash dev.sh demo|test [args]" >&2; exit 2 ;;
esac
