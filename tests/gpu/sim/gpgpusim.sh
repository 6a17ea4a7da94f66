#!/usr/bin/env bash
# Runs gn_mx's real PTX on GPGPU-Sim (the Accel-Sim project's fork, functional mode), no GPU needed.
#
#   GNMX_GPGPUSIM_SRC=PATH bash tests/gpu/sim/gpgpusim.sh build           # simulator + harness PTX
#   GNMX_GPGPUSIM_SRC=PATH bash tests/gpu/sim/gpgpusim.sh harness         # the harness PTX only
#   GNMX_GPGPUSIM_SRC=PATH bash tests/gpu/sim/gpgpusim.sh pytest [ARGS]   # tests/gpu ARGS on it
#   GNMX_GPGPUSIM_SRC=PATH bash tests/gpu/sim/gpgpusim.sh ci [ARGS]       # the list in ci_tests.txt
#   GNMX_GPGPUSIM_SRC=PATH bash tests/gpu/sim/gpgpusim.sh run CMD...      # any command on it
#   GNMX_GPGPUSIM_SRC=PATH bash tests/gpu/sim/gpgpusim.sh timing [ARGS]   # timing_tests.txt, timed
#
# PATH (or --src PATH before the command): a tarball of, or a clone of, the upstream simulator
# (https://github.com/accel-sim/gpgpu-sim_distribution, branch dev; measured at commit 667834cf).
# Steps, each cached:
#   1. the simulator: the source unpacked/copied, tests/gpu/sim/gpgpusim-fixes.patch applied (ten
#      defects that break gn_mx's kernels, one note each in the patch), `make` with GNMX_JOBS jobs
#      (default 2; ~3 min on 2 cores), in $GNMX_GPGPUSIM_CACHE/sim-<hash of source + patch + nvcc>;
#   2. the CUDA 11.8 toolkit (tools/cuda11_toolchain.sh; cached in GNMX_TOOLCHAIN_DIR);
#   3. the harness (src/operator/kernels/cuda_sources.txt + tests/gpu/harness.cc) as PTX only for
#      compute_70 (the simulated SM7_QV100 is a V100), linked with the shared CUDA runtime so that its
#      kernels register with the simulator's libcudart.so (~1 min), in .../harness-<hash of sources>;
#   4. the run: a fresh folder with the SM7_QV100 configs in functional mode (-gpgpu_ptx_sim_mode 1),
#      LD_LIBRARY_PATH = the simulator's libraries, PYTORCH_BIN = the harness (the simulator reads
#      the PTX from the file named there; without it it searches the python executable and crashes),
#      GNMX_HARNESS_EMU=0 GNMX_HARNESS_LIB=<harness> GNMX_HARNESS_SIM=1 for tests/gpu/harness_np.py.
# Every new process parses ~13 MB of PTX first (45-105 s): run many tests in one pytest process.
# GNMX_GPGPUSIM_TIMING=1 (set by the `timing` command): the performance model instead of functional
# mode (-gpgpu_ptx_sim_mode 0 in the config AND PTX_SIM_MODE_FUNC=0, which the simulator reads at
# every launch), with -gpgpu_kernel_launch_latency 0 and -gpgpu_perf_sim_memcpy 0 so that launch
# overhead and host copies do not enter kernel cycle counts (benchmarks/gpusim/, 10-100x slower).
#
# Environment: GNMX_GPGPUSIM_SRC, GNMX_GPGPUSIM_CACHE (default <repo>/build/gpgpusim, git-ignored),
# GNMX_JOBS, PYTHON (default <repo>/.venv/bin/python, else python3), GNMX_TOOLCHAIN_DIR.
# Exit codes: 0 ok, 2 usage, 4 no simulator source (the message says why), else the failure's.
# Debian packages it needs: gcc-11 g++-11 bison flex libxi-dev libxmu-dev xutils-dev zlib1g-dev
# (installed with apt-get when missing and running as root; otherwise named and exit 1).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
HERE="$ROOT/tests/gpu/sim"
PATCH="$HERE/gpgpusim-fixes.patch"
CACHE="${GNMX_GPGPUSIM_CACHE:-$ROOT/build/gpgpusim}"
JOBS="${GNMX_JOBS:-2}"
SRC="${GNMX_GPGPUSIM_SRC:-}"

log() { echo "[gpgpusim] $*" >&2; }
die() { log "$*"; exit 1; }

if [[ "${1:-}" == --src ]]; then SRC="${2:-}"; shift 2 || true; fi
cmd="${1:-}"
[[ $# -gt 0 ]] && shift
case "$cmd" in build|harness|pytest|ci|run|env) ;; timing) export GNMX_GPGPUSIM_TIMING=1 ;; *)
  sed -n '2,10p' "${BASH_SOURCE[0]}" >&2; exit 2 ;;
esac
TIMING="${GNMX_GPGPUSIM_TIMING:-0}"

if [[ -z "$SRC" ]]; then
  log "no simulator source: set GNMX_GPGPUSIM_SRC to a tarball or a clone of" \
      "accel-sim/gpgpu-sim_distribution (dev branch)"
  exit 4
fi
if [[ ! -e "$SRC" ]]; then
  log "simulator source $SRC does not exist"
  exit 4
fi
SRC="$(cd "$(dirname "$SRC")" && pwd)/$(basename "$SRC")"

# ---- host packages ---------------------------------------------------------------------------------
need_pkgs() {
  local missing=()
  command -v bison >/dev/null || missing+=(bison)
  command -v flex >/dev/null || missing+=(flex)
  command -v makedepend >/dev/null || missing+=(xutils-dev)
  command -v g++-11 >/dev/null || missing+=(gcc-11 g++-11)
  [[ -e /usr/include/X11/extensions/XInput.h ]] || missing+=(libxi-dev)
  [[ -e /usr/include/X11/Xmu/Xmu.h ]] || missing+=(libxmu-dev)
  [[ -e /usr/include/zlib.h ]] || missing+=(zlib1g-dev)
  ((${#missing[@]} == 0)) && return 0
  if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
    log "apt-get install ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >&2 ||
      { apt-get update -qq >&2 &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >&2; }
  else
    die "missing Debian packages: ${missing[*]} (apt-get install them, or run as root)"
  fi
}

sha() { sha256sum | cut -c1-16; }

# Identity of the source: the tarball's bytes; a git clone's HEAD and local changes; else its files.
src_id() {
  if [[ -f "$SRC" ]]; then
    sha256sum <"$SRC" | cut -d' ' -f1
  elif git -C "$SRC" rev-parse HEAD >/dev/null 2>&1; then
    { git -C "$SRC" rev-parse HEAD; git -C "$SRC" diff HEAD; } | sha256sum | cut -d' ' -f1
  else
    (cd "$SRC" && find . -type f ! -path './.git/*' ! -path './build/*' ! -path './lib/*' -print0 |
      LC_ALL=C sort -z | xargs -0 sha256sum) | sha256sum | cut -d' ' -f1
  fi
}

# ---- 1. CUDA 11.8 toolkit --------------------------------------------------------------------------
CUDA="$(bash "$ROOT/tools/cuda11_toolchain.sh")"
[[ -x "$CUDA/bin/nvcc" ]] || die "tools/cuda11_toolchain.sh gave no nvcc ($CUDA)"

# ---- 2. the simulator ------------------------------------------------------------------------------
mkdir -p "$CACHE"
KEY="$({ src_id; cat "$PATCH"; "$CUDA/bin/nvcc" --version | tail -n2; gcc --version | head -n1; } | sha)"
SIM="$CACHE/sim-$KEY"

build_sim() {
  need_pkgs
  local t0=$SECONDS tree="$SIM.tmp/gpgpu-sim"
  rm -rf "$SIM.tmp"
  mkdir -p "$tree"
  if [[ -f "$SRC" ]]; then
    log "unpacking $SRC"
    tar -xf "$SRC" -C "$tree" --strip-components=1
  else
    log "copying $SRC"
    (cd "$SRC" && tar -cf - --exclude=./.git --exclude=./build --exclude=./lib .) | tar -xf - -C "$tree"
  fi
  [[ -f "$tree/setup_environment" ]] || die "$SRC: no setup_environment (not a gpgpu-sim source tree)"
  if (cd "$tree" && patch -p1 -R --dry-run -s -f <"$PATCH" >/dev/null 2>&1); then
    log "gpgpusim-fixes.patch is already applied in $SRC"
  else
    (cd "$tree" && patch -p1 -s -f <"$PATCH") ||
      die "gpgpusim-fixes.patch does not apply to $SRC (made for upstream commit 667834cf)"
  fi
  log "building the simulator with $JOBS jobs (~3 min on 2 cores)"
  (
    cd "$tree"
    export CUDA_INSTALL_PATH="$CUDA"
    set +eu
    # shellcheck disable=SC1091
    source setup_environment release >"$SIM.tmp/setup.log" 2>&1 || { cat "$SIM.tmp/setup.log" >&2; exit 1; }
    set -eu
    make -j"$JOBS" >"$SIM.tmp/make.log" 2>&1 || { tail -n 40 "$SIM.tmp/make.log" >&2; exit 1; }
    echo "$GPGPUSIM_CONFIG" >"$SIM.tmp/config"
  ) || die "simulator build failed (log: $SIM.tmp/make.log)"
  local lib="$tree/lib/$(cat "$SIM.tmp/config")"
  [[ -e "$lib/libcudart.so" ]] || die "simulator build made no $lib/libcudart.so"
  echo "$lib" >"$SIM.tmp/libdir"
  rm -rf "$SIM"
  mv "$SIM.tmp" "$SIM"
  # the lib folder path moved with the rename
  sed -i "s#$SIM.tmp#$SIM#" "$SIM/libdir"
  log "simulator built in $((SECONDS - t0)) s: $SIM"
}

# ---- 3. the harness as PTX -------------------------------------------------------------------------
SRCS=()
while IFS= read -r line || [[ -n "$line" ]]; do
  line="${line%%#*}"; line="${line//[[:space:]]/}"
  [[ -n "$line" ]] && SRCS+=("$ROOT/src/operator/kernels/$line")
done <"$ROOT/src/operator/kernels/cuda_sources.txt"
SRCS+=("$ROOT/tests/gpu/harness.cc" "$HERE/sim_kernels.cu")  # + the benchmark's copy / FMA kernels
NVFLAGS=(-ccbin g++-11 -std=c++17 -O3 -shared -Xcompiler -fPIC,-fvisibility=hidden -DGNMX_WITH_CUDA
         -I"$ROOT/src/operator" -gencode arch=compute_70,code=compute_70 -cudart shared)
HKEY="$({ printf '%s\n' "${NVFLAGS[@]}"; "$CUDA/bin/nvcc" --version | tail -n1;
          find "$ROOT/src/operator/common" "$ROOT/src/operator/kernels" -type f \
            \( -name '*.h' -o -name '*.cuh' -o -name '*.cu' -o -name '*.txt' \) -print0 |
            LC_ALL=C sort -z | xargs -0 cat; cat "$ROOT/tests/gpu/harness.cc" "$HERE/sim_kernels.cu"; } | sha)"
HLIB="$CACHE/harness-$HKEY/libgn_harness.so"

build_harness() {
  local t0=$SECONDS d="$CACHE/harness-$HKEY"
  mkdir -p "$d"
  log "building the harness as compute_70 PTX with nvcc 11.8 (~1 min)"
  PATH="$CUDA/bin:$PATH" "$CUDA/bin/nvcc" "${NVFLAGS[@]}" "${SRCS[@]}" -ldl -o "$d/libgn_harness.so.tmp" ||
    die "nvcc failed on the harness"
  mv "$d/libgn_harness.so.tmp" "$HLIB"
  log "harness built in $((SECONDS - t0)) s: $HLIB"
}

(flock 9; [[ -f "$HLIB" ]] || build_harness) 9>"$CACHE/.lock-harness"
if [[ "$cmd" == harness ]]; then log "ready: harness $HLIB"; exit 0; fi
(flock 9; [[ -f "$SIM/libdir" ]] || build_sim) 9>"$CACHE/.lock-sim"
LIBDIR="$(cat "$SIM/libdir")"
CFG="$SIM/gpgpu-sim/configs/tested-cfgs/SM7_QV100"

# ---- 4. run ----------------------------------------------------------------------------------------
run_dir() {  # a fresh folder per run: the simulator reads gpgpusim.config from and writes into the cwd
  local d mode=1
  [[ "$TIMING" == 1 ]] && mode=0
  d="$(mktemp -d "$CACHE/run.XXXXXX")"
  cp "$CFG"/* "$d/"
  sed -i 's/^-gpgpu_ptx_sim_mode .*//' "$d/gpgpusim.config"
  # functional simulation or the timing model (the file ends without a newline, in a comment)
  printf '\n-gpgpu_ptx_sim_mode %s\n' "$mode" >>"$d/gpgpusim.config"
  if [[ "$TIMING" == 1 ]]; then
    sed -i -e 's/^-gpgpu_kernel_launch_latency .*//' -e 's/^-gpgpu_perf_sim_memcpy .*//' \
      "$d/gpgpusim.config"
    printf -- '-gpgpu_kernel_launch_latency 0\n-gpgpu_perf_sim_memcpy 0\n' >>"$d/gpgpusim.config"
  fi
  grep -qx -- "-gpgpu_ptx_sim_mode $mode" "$d/gpgpusim.config" || die "could not set the sim mode"
  echo "$d"
}

sim_env() {
  export LD_LIBRARY_PATH="$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export PYTORCH_BIN="$HLIB"
  export GNMX_HARNESS_EMU=0 GNMX_HARNESS_LIB="$HLIB" GNMX_HARNESS_SIM=1
  export CUDA_INSTALL_PATH="$CUDA"
  # what the simulator's setup_environment sets for CUDA >= 6 (PTX extracted per file by cuobjdump)
  export PTX_SIM_USE_PTX_FILE=1.ptx PTX_SIM_KERNELFILE=_1.ptx CUOBJDUMP_SIM_FILE=jj
  export PTX_SIM_MODE_FUNC=$((1 - TIMING))  # functional (1) or timing (0), read at every launch
}

PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"; else PY=python3; fi
fi

run_pytest() {  # pytest from the run folder; test paths made absolute
  local d args=() a
  d="$(run_dir)"
  for a in "$@"; do
    if [[ "$a" != -* && -e "$ROOT/${a%%::*}" ]]; then args+=("$ROOT/$a"); else args+=("$a"); fi
  done
  sim_env
  log "pytest on the simulator in $d (the first test waits for the PTX to be parsed)"
  local rc=0
  (cd "$d" && "$PY" -m pytest -c "$ROOT/pytest.ini" --rootdir="$ROOT" --confcutdir="$ROOT/tests/gpu" \
     -p no:cacheprovider "${args[@]}") || rc=$?
  rm -rf "$d"
  return $rc
}

case "$cmd" in
  build) log "ready: simulator $LIBDIR, harness $HLIB" ;;
  env)
    echo "export LD_LIBRARY_PATH=$LIBDIR\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
    echo "export PYTORCH_BIN=$HLIB GNMX_HARNESS_EMU=0 GNMX_HARNESS_LIB=$HLIB GNMX_HARNESS_SIM=1"
    echo "# and run from a folder holding $CFG/* with -gpgpu_ptx_sim_mode 1" ;;
  pytest)
    (($# > 0)) || set -- tests/gpu
    run_pytest "$@" ;;
  ci)
    mapfile -t list < <(sed -e 's/#.*//' -e 's/[[:space:]]*$//' -e '/^$/d' "$HERE/ci_tests.txt")
    run_pytest "${list[@]}" "$@" ;;
  timing)
    mapfile -t list < <(sed -e 's/#.*//' -e 's/[[:space:]]*$//' -e '/^$/d' "$HERE/timing_tests.txt")
    run_pytest "${list[@]}" "$@" ;;
  run)
    d="$(run_dir)"
    sim_env
    rc=0
    (cd "$d" && "$@") || rc=$?
    rm -rf "$d"
    exit $rc ;;
esac
