#!/usr/bin/env bash
# Prints the host's Debian mirror: the first .../debian URI of its deb822 sources
# (/etc/apt/sources.list.d/*.sources), else of its one-line /etc/apt/sources.list, else
# http://deb.debian.org/debian. Used by tools/cuda11_toolchain.sh and tools/bullseye_root.sh.
set -euo pipefail
mirror=""
for f in /etc/apt/sources.list.d/*.sources; do
  [ -f "$f" ] || continue
  u=$(awk '/^URIs:/{print $2; exit}' "$f")
  case "$u" in */debian) mirror="$u"; break ;; esac
done
if [ -z "$mirror" ] && [ -f /etc/apt/sources.list ]; then
  mirror=$(awk '$1=="deb" {for(i=2;i<=NF;i++) if ($i ~ /^https?:.*\/debian\/?$/) {print $i; exit}}' /etc/apt/sources.list)
fi
echo "${mirror:-http://deb.debian.org/debian}"
