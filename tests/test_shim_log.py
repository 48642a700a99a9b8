"""The HTP shim drops exactly one known-harmless QNN log message and forwards the rest;
it replaces the graph finalize optimization level when asked to.

Built against a stand-in for the real libQnnHtp.so (a few lines of C below): it
offers a provider whose logCreate keeps the callback it is given, and lets the
test emit messages through that callback as the HTP library would. The client
callback (executorch's, in real use) records what reaches it. Its graphCreate
records the graph custom configs it receives. Needs only a C compiler, no QNN SDK.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from qnn_convbwd.toolchain import sdk

FAKE_HTP = r"""
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

typedef void (*log_callback_fn)(const char *fmt, int level, uint64_t ts, va_list args);
typedef uint64_t (*log_create_fn)(log_callback_fn cb, int level, void **logger);

static log_callback_fn registered;
static char received[4096];

static uint64_t fake_log_create(log_callback_fn cb, int level, void **logger) {
  (void)level;
  registered = cb;
  *logger = (void *)&registered;
  return 0;
}

/* backendId, providerName, two API versions, then the function table at byte 40. */
static struct {
  char header[40];
  void *table[64];
} provider = {{0}, {0}};
static const void *providers[1] = {&provider};

/* graphCreate: records each custom config's option, type and value (executorch's
 * layout: uint32 option, payload at byte 8; the optimization payload uint32 type,
 * float value). */
static char graph_configs[1024];

static uint64_t fake_graph_create(void *context, const char *name, const void **configs,
                                  void **graph) {
  (void)context;
  (void)name;
  *graph = NULL;
  graph_configs[0] = 0;
  for (size_t i = 0; configs[i] != NULL; ++i) {
    const char *custom;
    memcpy(&custom, (const char *)configs[i] + 8, sizeof custom);
    uint32_t option, type;
    float value;
    memcpy(&option, custom, 4);
    memcpy(&type, custom + 8, 4);
    memcpy(&value, custom + 12, 4);
    size_t used = strlen(graph_configs);
    snprintf(graph_configs + used, sizeof graph_configs - used, "%u/%u/%g ", option, type,
             (double)value);
  }
  return 0;
}

/* What executorch's host build asks for: optimization (1) with the finalize flag (3)
 * at `level`, DLBC (type 4) off, and the precision (option 2) fp16 (1). */
const char *client_create_graph(float level) {
  static unsigned char custom[3][24];
  static unsigned char outer[3][16];
  const void *configs[4];
  uint32_t words[3][3] = {{1, 3, 0}, {1, 4, 0}, {2, 1, 0}};
  float values[3] = {level, 0.0f, 0.0f};
  memset(custom, 0, sizeof custom);
  memset(outer, 0, sizeof outer);
  for (int i = 0; i < 3; ++i) {
    memcpy(custom[i], &words[i][0], 4);
    memcpy(custom[i] + 8, &words[i][1], 4);
    memcpy(custom[i] + 12, &values[i], 4);
    const void *p = custom[i];
    memcpy(outer[i] + 8, &p, sizeof p);
    configs[i] = outer[i];
  }
  configs[3] = NULL;
  void *graph = NULL;
  typedef uint64_t (*graph_create_fn)(void *, const char *, const void **, void **);
  if (((graph_create_fn)provider.table[15])(NULL, "g", configs, &graph) != 0) return "failed";
  return graph_configs;
}

uint64_t QnnInterface_getProviders(const void ***out, uint32_t *count) {
  provider.table[15] = (void *)fake_graph_create;
  provider.table[25] = (void *)fake_log_create;
  *out = providers;
  *count = 1;
  return 0;
}

static void client_callback(const char *fmt, int level, uint64_t ts, va_list args) {
  (void)ts;
  size_t used = strlen(received);
  used += snprintf(received + used, sizeof received - used, "%d:", level);
  used += vsnprintf(received + used, sizeof received - used, fmt, args);
  snprintf(received + used, sizeof received - used, "\n");
}

/* What executorch does: create a logger through the (patched) provider table. */
int client_create_logger(void) {
  void *logger = NULL;
  return (int)((log_create_fn)provider.table[25])(client_callback, 1, &logger);
}

/* What the HTP library does: log through the callback it was given. */
void emit(int level, const char *fmt, ...) {
  va_list args;
  va_start(args, fmt);
  registered(fmt, level, 0, args);
  va_end(args);
}

const char *client_received(void) { return received; }
"""

CHILD = """
import ctypes, sys
fake = ctypes.CDLL(sys.argv[1])
shim = ctypes.CDLL(sys.argv[2])
providers, count = ctypes.c_void_p(), ctypes.c_uint32()
assert shim.QnnInterface_getProviders(ctypes.byref(providers), ctypes.byref(count)) == 0
assert fake.client_create_logger() == 0
emit = fake.emit
emit(1, b" <E> unexpected GraphHtpSettings option %d", ctypes.c_int(66))
emit(1, b" <E> Failed to create device: %s %d", b"socModel", ctypes.c_int(14001))
emit(2, b" <W> unexpected GraphHtpSettings option %d", ctypes.c_int(66))
fake.client_received.restype = ctypes.c_char_p
sys.stdout.write(fake.client_received().decode())
"""


@pytest.fixture(scope="module")
def libraries(tmp_path_factory):
    try:
        sdk._compiler()
    except sdk.SdkUnavailable as err:
        pytest.skip(str(err))
    work = tmp_path_factory.mktemp("shim_log")
    source = work / "fake_htp.c"
    source.write_text(FAKE_HTP)
    fake = work / "libfake_htp.so"
    subprocess.run(
        [sdk._compiler(), "-O1", "-fPIC", "-shared", "-Wall", "-Werror", "-o", str(fake),
         str(source)],
        check=True,
    )  # fmt: skip
    shim = work / "libQnnHtp.so"
    sdk.build_shim(fake, shim)
    return fake, shim


def _run(libraries, **env: str) -> list[str]:
    fake, shim = libraries
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD), str(fake), str(shim)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_only_the_option_66_error_is_dropped(libraries):
    assert _run(libraries, QNN_CONVBWD_QNN_LOG="") == [
        "1: <E> Failed to create device: socModel 14001",  # real errors still reach the client
        "2: <W> unexpected GraphHtpSettings option 66",  # the same text at another level too
    ]


def test_qnn_log_all_keeps_it(libraries):
    assert _run(libraries, QNN_CONVBWD_QNN_LOG="all") == [
        "1: <E> unexpected GraphHtpSettings option 66",
        "1: <E> Failed to create device: socModel 14001",
        "2: <W> unexpected GraphHtpSettings option 66",
    ]


GRAPH_CHILD = """
import ctypes, sys
fake = ctypes.CDLL(sys.argv[1])
shim = ctypes.CDLL(sys.argv[2])
providers, count = ctypes.c_void_p(), ctypes.c_uint32()
assert shim.QnnInterface_getProviders(ctypes.byref(providers), ctypes.byref(count)) == 0
fake.client_create_graph.restype = ctypes.c_char_p
fake.client_create_graph.argtypes = [ctypes.c_float]
sys.stdout.write(fake.client_create_graph(3.0).decode())
"""


@pytest.mark.parametrize(
    ("level", "received"),
    [
        ("", "1/3/3 1/4/0 2/1/0"),  # unset: executorch's configs pass through
        ("1", "1/3/1 1/4/0 2/1/0"),  # only the finalize flag's value changes
        ("2", "1/3/2 1/4/0 2/1/0"),
        ("7", "1/3/3 1/4/0 2/1/0"),  # not a level: ignored, with a message
    ],
)
def test_htp_optimization_replaces_the_finalize_level_only(libraries, level, received):
    fake, shim = libraries
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(GRAPH_CHILD), str(fake), str(shim)],
        capture_output=True,
        text=True,
        env={**os.environ, "QNN_CONVBWD_HTP_OPTIMIZATION": level},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == received.split()
    assert ("ignored" in proc.stderr) == (level == "7"), proc.stderr
