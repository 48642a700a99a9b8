/*
 * qnn_convbwd HTP compatibility shim.
 *
 * Loaded by executorch under the name libQnnHtp.so. It forwards
 * QnnInterface_getProviders to the real QAIRT HTP library (path fixed at build
 * time, QNN_CONVBWD_REAL_HTP) and replaces the provider's deviceCreate entry
 * with one that rewrites executorch 1.5.1's HTP device custom configs into the
 * layout of the loaded QAIRT release.
 *
 * Why: the HTP device custom config is {uint32 option; union payload}. Newer
 * QAIRT releases added a pointer-sized member to that union, which moved the
 * payload from byte offset 4 to byte offset 8. A client built against the old
 * headers (executorch 1.5.1) writes the payload at 4; the new library reads it
 * at 8, sees garbage and fails device creation ("unknown custom config socModel
 * 0", error 14001).
 *
 * Build flags:
 *   -DQNN_CONVBWD_REAL_HTP="/abs/path/libQnnHtp.so"   (required)
 *   -DQNN_CONVBWD_PAYLOAD_SHIFT=4   bytes the payload moves (0 = pass through)
 * Link with -Wl,-soname,libQnnHtp.so -Wl,-z,nodelete so that a later
 * dlopen("libQnnHtp.so") resolves to this object, never to the real library.
 *
 * It also wraps the provider's logCreate so that exactly one known-harmless
 * message of the HTP library is dropped: "<E> unexpected GraphHtpSettings
 * option 66", logged at error level during every graph creation for one of
 * the library's own settings (it appears with no graph configs at all, and
 * graph creation then succeeds). Every other message reaches executorch's
 * callback unchanged. QNN_CONVBWD_QNN_LOG=all keeps that message too.
 *
 * It wraps graphCreate so that QNN_CONVBWD_HTP_OPTIMIZATION=1|2|3 replaces the
 * finalize optimization level executorch's host build hard-codes (3): the level
 * decides how long QAIRT's graph finalisation takes. Unset, the configs pass
 * through unchanged.
 *
 * Set QNN_CONVBWD_SHIM_TRACE=1 to log every custom config it sees (and every
 * dropped message) to stderr.
 *
 * Only layout facts from the public QNN API are used here; no QNN header is
 * included or copied.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#ifndef QNN_CONVBWD_REAL_HTP
#error "QNN_CONVBWD_REAL_HTP must name the real libQnnHtp.so"
#endif
#ifndef QNN_CONVBWD_PAYLOAD_SHIFT
#define QNN_CONVBWD_PAYLOAD_SHIFT 4
#endif

typedef uint64_t qnn_status_t;
typedef qnn_status_t (*get_providers_fn)(const void ***providers, uint32_t *count);
typedef qnn_status_t (*device_create_fn)(void *logger, const void **configs, void **device);
typedef qnn_status_t (*graph_create_fn)(void *context, const char *name, const void **configs,
                                        void **graph);
/* QnnLog_Callback_t and QnnLog_CreateFn_t. */
typedef void (*log_callback_fn)(const char *fmt, int level, uint64_t timestamp, va_list args);
typedef qnn_status_t (*log_create_fn)(log_callback_fn callback, int max_level, void **logger);

/* QnnInterface_t: uint32 backendId, (pad), const char *providerName,
 * Qnn_ApiVersion_t (two 3 x uint32 versions) -> function table at byte 40. */
#define INTERFACE_TABLE_OFFSET 40
#define SLOT_GRAPH_CREATE 15
#define SLOT_LOG_CREATE 25
#define SLOT_DEVICE_CREATE 40

/* QnnDevice_Config_t / QnnGraph_Config_t: uint32 option, union at byte 8.
 * option 0 is QNN_*_CONFIG_OPTION_CUSTOM, whose union member is a pointer. */
#define CONFIG_OPTION_CUSTOM 0
#define CONFIG_UNION_OFFSET 8

/* Size of the rewritten HTP custom config we hand to the library: larger than
 * any layout of the struct, zero-filled beyond the payload. */
#define NEW_CUSTOM_CONFIG_BYTES 64
/* Payload bytes copied from the old layout. The old union's largest member
 * used by executorch (arch: uint32 deviceId + uint32 arch) is 8 bytes. */
#define OLD_PAYLOAD_BYTES 8
#define MAX_CONFIGS 64

/* The HTP graph custom config as executorch 1.5.1 and QAIRT 2.51 both lay it out
 * (read with QNN_CONVBWD_SHIM_TRACE=1): uint32 option, payload at byte 8. For the
 * optimization option (1) the payload is uint32 type, float value; type 3 is the
 * finalize optimization flag, which executorch's host build sets to 3. */
#define GRAPH_CUSTOM_CONFIG_BYTES 24
#define HTP_GRAPH_OPTION_OPTIMIZATION 1
#define HTP_OPTIMIZATION_FINALIZE_FLAG 3

static device_create_fn real_device_create;
static graph_create_fn real_graph_create;
static log_create_fn real_log_create;
static log_callback_fn client_log_callback; /* executorch's LoggingCallback */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int tracing = -1;

static int trace_enabled(void) {
  if (tracing < 0) {
    const char *v = getenv("QNN_CONVBWD_SHIM_TRACE");
    tracing = (v != NULL && v[0] != '\0' && v[0] != '0');
  }
  return tracing;
}

static void trace_bytes(const char *what, const void *p, size_t n) {
  if (!trace_enabled()) return;
  const unsigned char *b = (const unsigned char *)p;
  fprintf(stderr, "[qnn_convbwd shim] %s:", what);
  for (size_t i = 0; i < n; ++i) fprintf(stderr, "%s%02x", (i % 4 == 0) ? " " : "", b[i]);
  fprintf(stderr, "\n");
}

static uint32_t read_u32(const void *base, size_t offset) {
  uint32_t v;
  memcpy(&v, (const char *)base + offset, sizeof v);
  return v;
}

static const void *read_ptr(const void *base, size_t offset) {
  const void *v;
  memcpy(&v, (const char *)base + offset, sizeof v);
  return v;
}

static qnn_status_t shim_device_create(void *logger, const void **configs, void **device) {
  if (configs == NULL || QNN_CONVBWD_PAYLOAD_SHIFT == 0) {
    return real_device_create(logger, configs, device);
  }
  size_t n = 0;
  while (configs[n] != NULL && n < MAX_CONFIGS) ++n;

  /* Rewritten copies live on the stack for the duration of the call: the
   * library copies what it needs during deviceCreate. */
  unsigned char outer[MAX_CONFIGS][16];
  unsigned char custom[MAX_CONFIGS][NEW_CUSTOM_CONFIG_BYTES];
  const void *rewritten[MAX_CONFIGS + 1];
  for (size_t i = 0; i < n; ++i) {
    const void *cfg = configs[i];
    if (read_u32(cfg, 0) != CONFIG_OPTION_CUSTOM) {
      rewritten[i] = cfg;
      continue;
    }
    const void *old_custom = read_ptr(cfg, CONFIG_UNION_OFFSET);
    trace_bytes("device custom config (client layout)", old_custom, 4 + OLD_PAYLOAD_BYTES);
    memset(custom[i], 0, sizeof custom[i]);
    memcpy(custom[i], old_custom, 4); /* option */
    memcpy(custom[i] + 4 + QNN_CONVBWD_PAYLOAD_SHIFT, (const char *)old_custom + 4,
           OLD_PAYLOAD_BYTES);
    trace_bytes("device custom config (library layout)", custom[i], 8 + OLD_PAYLOAD_BYTES);
    memcpy(outer[i], cfg, sizeof outer[i]);
    const void *p = custom[i];
    memcpy(outer[i] + CONFIG_UNION_OFFSET, &p, sizeof p);
    rewritten[i] = outer[i];
  }
  rewritten[n] = NULL;
  return real_device_create(logger, rewritten, device);
}

/* The requested finalize optimization level (1 to 3), or 0 to keep the client's. */
static int optimization_level(void) {
  const char *v = getenv("QNN_CONVBWD_HTP_OPTIMIZATION");
  if (v == NULL || v[0] == '\0') return 0;
  if ((v[0] == '1' || v[0] == '2' || v[0] == '3') && v[1] == '\0') return v[0] - '0';
  fprintf(stderr, "[qnn_convbwd shim] QNN_CONVBWD_HTP_OPTIMIZATION=%s ignored (1, 2 or 3)\n", v);
  return 0;
}

static qnn_status_t shim_graph_create(void *context, const char *name, const void **configs,
                                      void **graph) {
  int level = optimization_level();
  size_t n = 0;
  while (configs != NULL && configs[n] != NULL && n < MAX_CONFIGS) ++n;
  /* Copies of the configs, the finalize optimization's value replaced; they live
   * for the call, the library copying what it keeps. */
  unsigned char outer[MAX_CONFIGS][16];
  unsigned char custom[MAX_CONFIGS][GRAPH_CUSTOM_CONFIG_BYTES];
  const void *rewritten[MAX_CONFIGS + 1];
  for (size_t i = 0; i < n; ++i) {
    const void *cfg = configs[i];
    rewritten[i] = cfg;
    trace_bytes("graph config", cfg, 16);
    if (read_u32(cfg, 0) != CONFIG_OPTION_CUSTOM) continue;
    const void *old_custom = read_ptr(cfg, CONFIG_UNION_OFFSET);
    trace_bytes("  graph custom config", old_custom, GRAPH_CUSTOM_CONFIG_BYTES);
    if (level == 0 || read_u32(old_custom, 0) != HTP_GRAPH_OPTION_OPTIMIZATION ||
        read_u32(old_custom, CONFIG_UNION_OFFSET) != HTP_OPTIMIZATION_FINALIZE_FLAG) {
      continue;
    }
    memcpy(custom[i], old_custom, sizeof custom[i]);
    float value = (float)level;
    memcpy(custom[i] + CONFIG_UNION_OFFSET + 4, &value, sizeof value);
    trace_bytes("  graph custom config (rewritten)", custom[i], GRAPH_CUSTOM_CONFIG_BYTES);
    memcpy(outer[i], cfg, sizeof outer[i]);
    const void *p = custom[i];
    memcpy(outer[i] + CONFIG_UNION_OFFSET, &p, sizeof p);
    rewritten[i] = outer[i];
  }
  rewritten[n] = NULL;
  if (real_graph_create == NULL) return 1; /* the provider offered no graphCreate */
  return real_graph_create(context, name, configs == NULL ? NULL : rewritten, graph);
}

/* QnnLog_Level_t QNN_LOG_LEVEL_ERROR */
#define LOG_LEVEL_ERROR 1
#define LOG_BUFFER_BYTES 512
static const char HARMLESS_MESSAGE[] = "unexpected GraphHtpSettings option 66";

static int keep_every_message(void) {
  const char *v = getenv("QNN_CONVBWD_QNN_LOG");
  return v != NULL && strcmp(v, "all") == 0;
}

static void shim_log_callback(const char *fmt, int level, uint64_t timestamp, va_list args) {
  if (level == LOG_LEVEL_ERROR && !keep_every_message()) {
    char message[LOG_BUFFER_BYTES];
    va_list copy;
    va_copy(copy, args);
    vsnprintf(message, sizeof message, fmt, copy);
    va_end(copy);
    if (strstr(message, HARMLESS_MESSAGE) != NULL) {
      if (trace_enabled()) fprintf(stderr, "[qnn_convbwd shim] dropped: %s\n", message);
      return;
    }
  }
  client_log_callback(fmt, level, timestamp, args);
}

static qnn_status_t shim_log_create(log_callback_fn callback, int max_level, void **logger) {
  pthread_mutex_lock(&lock);
  int wrap = callback != NULL &&
             (client_log_callback == NULL || client_log_callback == callback);
  if (wrap) client_log_callback = callback;
  pthread_mutex_unlock(&lock);
  /* A second, different client callback is passed through unfiltered. */
  return real_log_create(wrap ? shim_log_callback : callback, max_level, logger);
}

static int patch_slot(const void *provider, int slot, void *replacement, void **original) {
  void **entry = (void **)((char *)provider + INTERFACE_TABLE_OFFSET) + slot;
  if (*entry == replacement) return 0; /* already patched */
  if (*original != NULL && *original != *entry) {
    fprintf(stderr, "[qnn_convbwd shim] providers disagree on slot %d\n", slot);
    return -1;
  }
  long page = sysconf(_SC_PAGESIZE);
  uintptr_t start = (uintptr_t)entry & ~(uintptr_t)(page - 1);
  if (mprotect((void *)start, (size_t)page * 2, PROT_READ | PROT_WRITE) != 0) {
    perror("[qnn_convbwd shim] mprotect");
    return -1;
  }
  *original = *entry;
  *entry = replacement;
  return 0;
}

__attribute__((visibility("default"))) qnn_status_t QnnInterface_getProviders(
    const void ***providers, uint32_t *count) {
  static get_providers_fn real_get_providers;
  pthread_mutex_lock(&lock);
  if (real_get_providers == NULL) {
    void *real = dlopen(QNN_CONVBWD_REAL_HTP, RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
    if (real == NULL) {
      fprintf(stderr, "[qnn_convbwd shim] cannot load %s: %s\n", QNN_CONVBWD_REAL_HTP, dlerror());
      pthread_mutex_unlock(&lock);
      return 1;
    }
    real_get_providers = (get_providers_fn)dlsym(real, "QnnInterface_getProviders");
    if (real_get_providers == NULL) {
      fprintf(stderr, "[qnn_convbwd shim] no QnnInterface_getProviders in %s\n",
              QNN_CONVBWD_REAL_HTP);
      pthread_mutex_unlock(&lock);
      return 1;
    }
  }
  qnn_status_t status = real_get_providers(providers, count);
  if (status == 0 && providers != NULL && *providers != NULL && count != NULL) {
    for (uint32_t i = 0; i < *count; ++i) {
      const void *p = (*providers)[i];
      if (patch_slot(p, SLOT_DEVICE_CREATE, (void *)shim_device_create,
                     (void **)&real_device_create) != 0 ||
          patch_slot(p, SLOT_LOG_CREATE, (void *)shim_log_create, (void **)&real_log_create) !=
              0 ||
          patch_slot(p, SLOT_GRAPH_CREATE, (void *)shim_graph_create,
                     (void **)&real_graph_create) != 0) {
        status = 1;
        break;
      }
    }
  }
  pthread_mutex_unlock(&lock);
  return status;
}

/* Lets the Python side confirm which object answers to libQnnHtp.so. */
__attribute__((visibility("default"))) const char *qnn_convbwd_shim_real_library(void) {
  return QNN_CONVBWD_REAL_HTP;
}
