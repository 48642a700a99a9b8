"""Keep executorch's chatter out of the way: warnings and our own output by default.

Three sources, three mechanisms:

* **Python logging.** Two executorch modules force their loggers to DEBUG at
  import (``logger.setLevel(logging.DEBUG)`` in ``qnn_partitioner.py`` and
  ``qnn_preprocess.py``: one line per node), and ``_passes/convert_mha_to_sha.py``
  calls ``logging.basicConfig(level=logging.INFO)`` at import, which gives a
  process that configured nothing a root handler at INFO. ``quiet_libraries()``
  hands those loggers back to the application's configuration (level NOTSET)
  and removes that import-time root handler. A few warnings known to be
  harmless here are shown only when their logger is at INFO or below
  (``HARMLESS_LOG_RECORDS``), and two Python warnings are ignored
  (``HARMLESS_WARNINGS``). ``logging.basicConfig(level=logging.INFO)`` (or
  ``qnn-convbwd --verbose``) brings all of it back.
* **The QNN library's log callback.** The HTP shim drops exactly the
  known-harmless ``<E> unexpected GraphHtpSettings option 66`` line
  (``htp_shim.c``); every other QNN message, errors included, is printed.
* **executorch's native prints.** executorch's C++ runtime writes its own
  ``[INFO] [Qnn ExecuTorch]: ...`` lines straight to the stderr file
  descriptor whatever the log level. Only the CLI filters those
  (``filtered_native_output``): a library does not own the process's file
  descriptors.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterator

logger = logging.getLogger(__name__)

# executorch modules that set their own logger to DEBUG at import.
FORCED_DEBUG_LOGGERS = (
    "executorch.backends.qualcomm.partition.qnn_partitioner",
    "executorch.backends.qualcomm.qnn_preprocess",
)
# Format of the root handler executorch's convert_mha_to_sha.py installs at import.
EXECUTORCH_ROOT_FORMAT = "[%(levelname)s %(asctime)s %(filename)s:%(lineno)s] %(message)s"

# (logger, message regex, why it is harmless): shown only when the logger is at INFO or below.
HARMLESS_LOG_RECORDS = (
    (
        "root",
        r"Op \S+ was requested for preservation by partitioner\.\s+This request is ignored "
        r"because it aliases output",
        "QnnPartitioner asks to keep aten.unbind; to_edge declines for ops aliasing an output",
    ),
    (
        "executorch.exir.pass_manager",
        r"PassManager is deprecated",
        "executorch's own QNN passes still use the deprecated class",
    ),
    ("torchao", r"Failed to load .*torchao/_C", "torchao's optional CUDA kernels"),
    ("torchao.kernel.intmm", r"Detected no triton", "torchao's optional Triton kernels"),
    (
        "torch.utils._pytree",
        r"is an Enum subclass and is now natively supported",
        "torchao registers an Enum with torch's pytree at import",
    ),
)
# (category, message regex, why it is harmless): ignored unless executorch logs at INFO.
HARMLESS_WARNINGS = (
    (
        FutureWarning,
        r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        "torch's pytree deprecation, raised inside torch.export serialization",
    ),
    (
        UserWarning,
        r"Function aten\.convolution_backward\.out's out\d kwarg value is None",
        "memory planning of the gradients the output mask does not ask for (nothing to plan)",
    ),
)

_lock = threading.Lock()
_filtered_loggers: set[str] = set()
_warnings_ignored = False


class _HarmlessRecords(logging.Filter):
    """Drops the known-harmless records of one logger unless it is at INFO or below."""

    def __init__(self, target: logging.Logger, patterns: list[str]) -> None:
        super().__init__()
        self.target = target
        self.patterns = [re.compile(p) for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        if self.target.getEffectiveLevel() <= logging.INFO:
            return True
        message = record.getMessage()
        return not any(p.search(message) for p in self.patterns)


def quiet_libraries() -> None:
    """Hand executorch's loggers back to the application's logging configuration (idempotent).

    Called by ``qnn_convbwd.enable()`` and by the CLI; safe to call again after
    more of executorch was imported.
    """
    global _warnings_ignored
    with _lock:
        for name in FORCED_DEBUG_LOGGERS:
            forced = logging.getLogger(name)
            if forced.level == logging.DEBUG:
                forced.setLevel(logging.NOTSET)
        root = logging.getLogger()
        for handler in list(root.handlers):
            fmt = getattr(handler.formatter, "_fmt", None)
            if fmt == EXECUTORCH_ROOT_FORMAT and type(handler) is logging.StreamHandler:
                root.removeHandler(handler)
                if root.level == logging.INFO:
                    root.setLevel(logging.WARNING)
                logger.debug("removed the root log handler executorch installs at import")
        by_logger: dict[str, list[str]] = {}
        for name, pattern, _ in HARMLESS_LOG_RECORDS:
            by_logger.setdefault(name, []).append(pattern)
        for name, patterns in by_logger.items():
            if name not in _filtered_loggers:
                target = logging.getLogger() if name == "root" else logging.getLogger(name)
                target.addFilter(_HarmlessRecords(target, patterns))
                _filtered_loggers.add(name)
        if not _warnings_ignored and logging.getLogger("executorch").getEffectiveLevel() > (
            logging.INFO
        ):
            for category, pattern, _ in HARMLESS_WARNINGS:
                warnings.filterwarnings("ignore", message=pattern, category=category)
            _warnings_ignored = True


# --- native output (CLI only) ------------------------------------------------------------------

# Lines of executorch's C++ runtime and the QNN libraries that the CLI drops by default.
NATIVE_CHATTER = (
    rb"^\[(INFO|VERBOSE|DEBUG)\] \[Qnn ExecuTorch\]: ",  # executorch's unconditional prints
    rb"^\[ERROR\] \[Qnn ExecuTorch\]:\s+<E> unexpected GraphHtpSettings option 66\s*$",
    rb"^I \d\d:\d\d:\d\d\.\d+ executorch:",  # ET_LOG at info level
    rb"^\[cpuinfo_utils\.cpp:\d+\] ",  # executorch's runtime probing the host CPU
    rb"^ # LIBNATIVE: No alternate configuration present",  # the HTP simulator's start
)
# Native warnings shown once per process however often they repeat.
NATIVE_ONCE = rb"^\[WARNING\] \[Qnn ExecuTorch\]: "

# Reads lines, drops the chatter, passes on the rest; should it fail, everything passes.
_FILTER_PROGRAM = r"""
import re, shutil, sys
inp, out = sys.stdin.buffer, sys.stdout.buffer
try:
    drop = [re.compile(p.encode()) for p in sys.argv[1:-1]]
    once, seen = re.compile(sys.argv[-1].encode()), set()
    for line in inp:
        if any(p.search(line) for p in drop):
            continue
        if once.search(line):
            if line in seen:
                continue
            seen.add(line)
        out.write(line)
        out.flush()
except Exception as err:
    out.write(f"[qnn-convbwd output filter failed: {err}; passing all output]\n".encode())
    shutil.copyfileobj(inp, out)
"""


@contextlib.contextmanager
def filtered_native_output(fds: tuple[int, ...] = (1, 2)) -> Iterator[dict[int, int]]:
    """Pass the file descriptors ``fds`` through a filter process dropping ``NATIVE_CHATTER``.

    A separate process rather than a thread: when this process crashes, the
    filter still reads everything written before the crash (the traceback
    included) and passes it on. Yields ``{fd: duplicate of the original fd}``,
    for output that must bypass the filter (progress bars); ``{}`` when the
    descriptors cannot be redirected (output then passes unfiltered).
    """
    patterns = [p.decode() for p in NATIVE_CHATTER] + [NATIVE_ONCE.decode()]
    originals: dict[int, int] = {}
    filters: list[subprocess.Popen] = []
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    try:
        for fd in fds:
            original = os.dup(fd)
            originals[fd] = original
            read, write = os.pipe()
            filters.append(
                subprocess.Popen(
                    [sys.executable, "-I", "-S", "-c", _FILTER_PROGRAM, *patterns],
                    stdin=read,
                    stdout=original,
                    close_fds=True,
                )
            )
            os.close(read)
            os.dup2(write, fd)
            os.close(write)
    except OSError as err:  # e.g. a closed descriptor: run unfiltered
        logger.debug("native output not filtered: %s", err)
        _restore(originals, filters)
        originals, filters = {}, []
    try:
        yield dict(originals)
    finally:
        _restore(originals, filters)


def _restore(originals: dict[int, int], filters: list[subprocess.Popen]) -> None:
    """Flush, put the original descriptors back and let the filters drain."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(ValueError, OSError):
            stream.flush()
    for fd, original in originals.items():
        os.dup2(original, fd)  # closes the pipe's last write end: the filter sees EOF
    for proc in filters:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
    for original in originals.values():
        os.close(original)
