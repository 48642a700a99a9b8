/*
 * qnn_convbwd Saver loader shim.
 *
 * Loaded by executorch under the name libQnnSaver.so. It forwards
 * QnnInterface_getProviders and QnnSaver_initialize to the real QAIRT Saver
 * library (path fixed at build time, QNN_CONVBWD_REAL_SAVER), which it loads
 * itself and loads afresh for every Saver session.
 *
 * Why: the process cannot find libQnnSaver.so by its bare name (the loader
 * read LD_LIBRARY_PATH before the SDK root existed), so qnn_convbwd keeps it
 * loaded by absolute path. But the Saver accepts QnnSaver_initialize once per
 * load of the library (a second call fails with error 4951), and executorch
 * calls it for every backend it starts: the first lowering with Saver compile
 * specs works and the next one fails. Plain executorch works only because its
 * dlclose unloads the library between lowerings. This object stays loaded
 * (it answers to the bare name); the real Saver behind it is unloaded and
 * loaded again whenever a new session asks for the providers after an
 * initialize.
 *
 * Build flags:
 *   -DQNN_CONVBWD_REAL_SAVER="/abs/path/libQnnSaver.so"   (required)
 * Link with -Wl,-soname,libQnnSaver.so -Wl,-z,nodelete.
 *
 * Set QNN_CONVBWD_SHIM_TRACE=1 to log every reload to stderr.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#ifndef QNN_CONVBWD_REAL_SAVER
#error "QNN_CONVBWD_REAL_SAVER must name the real libQnnSaver.so"
#endif

typedef uint64_t qnn_status_t;
typedef qnn_status_t (*get_providers_fn)(const void ***providers, uint32_t *count);
typedef qnn_status_t (*saver_initialize_fn)(const void **config);

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static void *real;       /* the real Saver of the current session */
static int initialized;  /* QnnSaver_initialize succeeded on `real` */

static int trace_enabled(void) {
  const char *v = getenv("QNN_CONVBWD_SHIM_TRACE");
  return v != NULL && v[0] != '\0' && v[0] != '0';
}

/* The real Saver; unloaded and loaded again first when `fresh` and it was initialized. */
static void *real_saver(int fresh) {
  if (real != NULL && fresh && initialized) {
    dlclose(real);
    real = NULL;
    initialized = 0;
    void *still = dlopen(QNN_CONVBWD_REAL_SAVER, RTLD_NOW | RTLD_NOLOAD);
    if (still != NULL) { /* someone else holds it: its state cannot be reset */
      fprintf(stderr, "[qnn_convbwd saver shim] %s stayed loaded\n", QNN_CONVBWD_REAL_SAVER);
      dlclose(still);
    }
    if (trace_enabled()) fprintf(stderr, "[qnn_convbwd saver shim] reloading the Saver\n");
  }
  if (real == NULL) {
    real = dlopen(QNN_CONVBWD_REAL_SAVER, RTLD_NOW | RTLD_LOCAL);
    if (real == NULL) {
      fprintf(stderr, "[qnn_convbwd saver shim] cannot load %s: %s\n", QNN_CONVBWD_REAL_SAVER,
              dlerror());
    }
  }
  return real;
}

static void *real_symbol(void *handle, const char *name) {
  void *fn = handle == NULL ? NULL : dlsym(handle, name);
  if (handle != NULL && fn == NULL) {
    fprintf(stderr, "[qnn_convbwd saver shim] no %s in %s\n", name, QNN_CONVBWD_REAL_SAVER);
  }
  return fn;
}

__attribute__((visibility("default"))) qnn_status_t QnnInterface_getProviders(
    const void ***providers, uint32_t *count) {
  pthread_mutex_lock(&lock);
  get_providers_fn fn = (get_providers_fn)real_symbol(real_saver(1), "QnnInterface_getProviders");
  qnn_status_t status = fn == NULL ? 1 : fn(providers, count);
  pthread_mutex_unlock(&lock);
  return status;
}

__attribute__((visibility("default"))) qnn_status_t QnnSaver_initialize(const void **config) {
  pthread_mutex_lock(&lock);
  saver_initialize_fn fn = (saver_initialize_fn)real_symbol(real_saver(0), "QnnSaver_initialize");
  qnn_status_t status = fn == NULL ? 1 : fn(config);
  if (status == 0) initialized = 1;
  pthread_mutex_unlock(&lock);
  return status;
}

/* Lets the Python side confirm which object answers to libQnnSaver.so. */
__attribute__((visibility("default"))) const char *qnn_convbwd_shim_real_library(void) {
  return QNN_CONVBWD_REAL_SAVER;
}
