/*
 * glibc_compat.c: the one glibc symbol the static libstdc++ (gcc 11) refers to that glibc 2.17 does
 * not have, defined inside libgn_mx.so for the manylinux2014 wheel (tools/manylinux/glibc217.sh
 * links it in; the export map keeps it local, so it never replaces the process's own).
 *
 * __libc_single_threaded (glibc 2.32+): libstdc++ reads it to skip atomic reference counting while
 * a process has one thread. 0 means "not known to be single-threaded": libstdc++ then always uses
 * the atomic operations, which is what it does on every glibc older than 2.32. Never written.
 */
char __libc_single_threaded = 0;
