#!/usr/bin/env bash
# An older distribution to install the wheels into: a Debian bullseye root (glibc 2.31, Python 3.9),
# made once with debootstrap from Debian's package registry (tests/test_wheel_bullseye.py uses it).
#
#   bash tools/bullseye_root.sh DIR     # makes DIR (once; ~2 min), prints DIR
#
# Needs root (debootstrap, chroot; tests mount /proc and a /dev/shm into it while they run). Installs
# debootstrap with apt-get when it is missing. The root gets python3, python3-venv and the two
# libraries `import mxnet` needs (libgomp1, libquadmath0), nothing else, plus the host's CA bundle and
# pip configuration (so pip inside reaches the same package index as the host).
set -euo pipefail
[ $# = 1 ] || { echo "usage: bash tools/bullseye_root.sh DIR" >&2; exit 2; }
DIR="$(mkdir -p "$1" && cd "$1" && pwd)"
SUITE=bullseye
INCLUDE=python3,python3-venv,libgomp1,libquadmath0
log() { echo "[bullseye] $*" >&2; }
[ "$(id -u)" = 0 ] || { log "needs root (debootstrap, chroot)"; exit 1; }

if [ "$(cat "$DIR/.gnmx-root" 2>/dev/null)" != "$SUITE $INCLUDE" ]; then
  if ! command -v debootstrap >/dev/null; then
    log "installing debootstrap"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >&2 ||
      { apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >&2; }
  fi
  mirror=$(bash "$(dirname "${BASH_SOURCE[0]}")/debian_mirror.sh")  # the host's Debian mirror
  log "debootstrap $SUITE ($INCLUDE) from $mirror into $DIR"
  find "$DIR" -mindepth 1 -maxdepth 1 -exec rm -rf {} +
  t0=$(date +%s)
  debootstrap --variant=minbase --include="$INCLUDE" "$SUITE" "$DIR" "$mirror" >&2
  log "root made in $(( $(date +%s) - t0 )) s"
  echo "$SUITE $INCLUDE" > "$DIR/.gnmx-root"
fi

# pip inside the root: the host's CA bundle and pip configuration (refreshed every time).
mkdir -p "$DIR/etc/ssl/certs" "$DIR/etc/xdg/pip"
cp /etc/ssl/certs/ca-certificates.crt "$DIR/etc/ssl/certs/ca-certificates.crt"
[ -f /etc/pip.conf ] && cp /etc/pip.conf "$DIR/etc/pip.conf"
if compgen -G "/etc/xdg/pip/*" >/dev/null; then cp /etc/xdg/pip/* "$DIR/etc/xdg/pip/"; fi
echo "$DIR"
