#!/usr/bin/env bash
# Link against glibc 2.17 (manylinux2014's) on a newer build host, for the binary wheel.
#
#   bash tools/manylinux/glibc217.sh PYTHON DIR    # prints the linker flags on stdout
#
# PYTHON: an interpreter with PyPI's `ziglang` installed (tools/build_wheel.sh pins it). Zig ships
# the symbol lists of every glibc release and writes link stubs for the one a target names: here
# `x86_64-linux-gnu.2.17`. The stubs (libc.so.6, libm.so.6, libpthread.so.0, libdl.so.2, librt.so.1,
# ld-linux-x86-64.so.2: ELF shared objects that carry the 2.17 symbols with their versions, no code)
# and zig's libc_nonshared.a go to DIR/lib with the linker names (libc.so is a linker script, as
# glibc's own). The library is still compiled and linked by gcc (g++-11: the code, the OpenMP runtime
# libgomp and the CUDA host compiler stay what they are); `-L DIR/lib` makes `-lc -lm -lpthread -ldl
# -lrt` bind there, so every glibc symbol gets its 2.17-or-older version, and `-z defs` turns a symbol
# that glibc 2.17 lacks (or a library not named) into a link error instead of a library that fails
# to load on old systems.
# glibc_compat.c (beside this script) defines the two such symbols gcc 11's static libstdc++ uses.
#
# Environment: CC (C compiler for glibc_compat.c, default gcc-11 or gcc).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
[ $# = 2 ] || { echo "usage: bash tools/manylinux/glibc217.sh PYTHON DIR" >&2; exit 2; }
PY="$1"
DIR="$(mkdir -p "$2" && cd "$2" && pwd)"
TARGET=x86_64-linux-gnu.2.17
log() { echo "[glibc217] $*" >&2; }

LIB="$DIR/lib"
stamp="$LIB/.ok"
want="$("$PY" -m ziglang version) $TARGET"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  log "glibc 2.17 link stubs from zig $("$PY" -m ziglang version) -> $LIB"
  rm -rf "$LIB" "$DIR/zig-cache"
  mkdir -p "$LIB" "$DIR/probe"
  # Linking a trivial library for the target makes zig write the stubs into its cache.
  echo 'int gnmx_glibc217_probe(void) { return 0; }' > "$DIR/probe/probe.c"
  ZIG_GLOBAL_CACHE_DIR="$DIR/zig-cache" ZIG_LOCAL_CACHE_DIR="$DIR/zig-cache" \
    "$PY" -m ziglang cc -target "$TARGET" -shared -o "$DIR/probe/probe.so" "$DIR/probe/probe.c" \
    -lm -lpthread -ldl -lrt >&2
  one() {  # the one file of that name zig wrote
    local found
    found=$(find "$DIR/zig-cache" -name "$1")
    [ "$(echo "$found" | grep -c .)" = 1 ] || { log "expected one $1 in zig's cache, found: $found"; exit 1; }
    echo "$found"
  }
  for so in libc.so.6 libm.so.6 libpthread.so.0 libdl.so.2 librt.so.1; do
    cp "$(one "$so")" "$LIB/$so"
    ln -s "$so" "$LIB/${so%%.so*}.so"
  done
  cp "$(one libld.so.2)" "$LIB/ld-linux-x86-64.so.2"   # its SONAME is ld-linux-x86-64.so.2
  cp "$(one libc_nonshared.a)" "$LIB/libc_nonshared.a"
  rm "$LIB/libc.so"
  printf 'GROUP ( %s %s AS_NEEDED ( %s ) )\n' "$LIB/libc.so.6" "$LIB/libc_nonshared.a" \
    "$LIB/ld-linux-x86-64.so.2" > "$LIB/libc.so"
  newest=$(objdump -T "$LIB/libc.so.6" | grep -o 'GLIBC_2\.[0-9]*' | sort -uV | tail -1)
  [ "$newest" = GLIBC_2.17 ] || { log "zig's stubs are not glibc 2.17's (newest: $newest)"; exit 1; }
  rm -rf "$DIR/probe"
  echo "$want" > "$stamp"
fi
CC="${CC:-$(command -v gcc-11 || command -v gcc)}"
"$CC" -O2 -fPIC -Wall -Werror -c "$HERE/glibc_compat.c" -o "$DIR/glibc_compat.o"
# glibc 2.17 keeps pthread_* and dlopen/dlsym in libpthread / libdl (2.34 moved them into libc, so
# today's compilers do not name them): named here, always recorded (--no-as-needed).
echo "-L$LIB -Wl,-z,defs $DIR/glibc_compat.o -Wl,--no-as-needed -lpthread -ldl"
