/*
 * glibc_compat.c: the glibc symbols that gcc 11's static libstdc++ refers to and glibc 2.17 does not
 * have, defined inside libgn_mx.so for the manylinux2014 wheel (tools/manylinux/glibc217.sh links
 * this object in; the export map src/link/gn_mx.map keeps both local, so they never replace the
 * process's own and bind only inside the library). The link uses `-z defs`: a new such symbol is a
 * link error, not a library that fails to load on an old system.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>

/*
 * __libc_single_threaded (glibc 2.32+): libstdc++ reads it to skip atomic reference counting while
 * a process has one thread. 0 means "not known to be single-threaded": libstdc++ then always uses
 * the atomic operations, which is what it does on every glibc older than 2.32. Never written.
 */
char __libc_single_threaded = 0;

/*
 * __cxa_thread_atexit_impl (glibc 2.18+): registers the destructor of a thread_local object.
 * Where the process's glibc has it (2.18 and newer: every distribution but the 2.17 ones) it is
 * looked up once and called, so the C library's own bookkeeping (destructor order, the library kept
 * loaded while destructors are pending) applies. On glibc 2.17 the destructors are kept in a
 * per-thread list run by a pthread key destructor when the thread exits - libstdc++'s own fallback
 * for a C library without it, i.e. what a compiler built for glibc 2.17 does. As there, the main
 * thread's list is not run at exit (MXNet never unloads the library, and the only thread_local
 * objects here hold error-message strings).
 */
typedef void (*gnmx_dtor)(void *);
typedef int (*gnmx_thread_atexit_fn)(gnmx_dtor, void *, void *);

struct gnmx_dtor_node {
  gnmx_dtor fn;
  void *obj;
  struct gnmx_dtor_node *next;
};

static pthread_once_t gnmx_once = PTHREAD_ONCE_INIT;
static gnmx_thread_atexit_fn gnmx_glibc_impl;
static pthread_key_t gnmx_key;
static int gnmx_key_ok;

static void gnmx_run_dtors(void *head) {  /* newest first, as glibc; more may be added meanwhile */
  struct gnmx_dtor_node *n = (struct gnmx_dtor_node *)head;
  while (n != NULL) {
    struct gnmx_dtor_node *next = n->next;
    n->fn(n->obj);
    free(n);
    n = next;
  }
}

static void gnmx_init(void) {
  gnmx_glibc_impl = (gnmx_thread_atexit_fn)dlsym(RTLD_DEFAULT, "__cxa_thread_atexit_impl");
  if (gnmx_glibc_impl == NULL) gnmx_key_ok = pthread_key_create(&gnmx_key, gnmx_run_dtors) == 0;
}

int __cxa_thread_atexit_impl(gnmx_dtor fn, void *obj, void *dso_symbol) {
  pthread_once(&gnmx_once, gnmx_init);
  if (gnmx_glibc_impl != NULL) return gnmx_glibc_impl(fn, obj, dso_symbol);
  if (!gnmx_key_ok) return -1;
  struct gnmx_dtor_node *n = (struct gnmx_dtor_node *)malloc(sizeof *n);
  if (n == NULL) return -1;
  n->fn = fn;
  n->obj = obj;
  n->next = (struct gnmx_dtor_node *)pthread_getspecific(gnmx_key);
  if (pthread_setspecific(gnmx_key, n) != 0) {
    free(n);
    return -1;
  }
  return 0;
}
