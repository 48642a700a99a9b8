"""Find or assemble a QNN SDK root that executorch 1.5.1 can use, in this process.

Order of preference:

1. ``QNN_SDK_ROOT`` set by the user: used as is; the environment is not touched.
2. Otherwise a root assembled from the ``onnxruntime-qnn`` wheel (QAIRT x86-64
   libraries) in a user cache directory: ``<cache>/sdk-<key>/lib/x86_64-linux-clang``
   holds links to the wheel's libraries, and its ``libQnnHtp.so`` is the
   compatibility shim (``htp_shim.c``) when the libraries need it; its ``libQnnSaver.so``
   is the Saver loader shim (``saver_shim.c``). ``<key>`` fingerprints the
   wheel's libraries and the shim sources, so a changed shim source is rebuilt
   into a new root. ``ensure_sdk`` exports ``QNN_SDK_ROOT``
   for executorch; a child process that inherits it recognises the root by
   its marker file (``MARKER``) and takes this path again rather than treating
   the root as a user's SDK.

The shim exists because executorch 1.5.1 writes the HTP device custom config in
the layout of the QNN headers it was built with; QAIRT 2.47 and newer moved the
payload of that struct from byte 4 to byte 8 (see ``htp_shim.c``). Whether a
library needs it is decided from its build id (``SHIM_FROM_VERSION``); the
``QNN_CONVBWD_SHIM`` variable (``auto``/``on``/``off``) overrides that.

The dynamic loader reads ``LD_LIBRARY_PATH`` once, at process start, so this
module also loads the libraries executorch later opens by bare name
(``libQnnHtp.so``, ``libQnnSystem.so``, ``libQnnSaver.so``) by absolute path;
a later ``dlopen`` of the bare name then finds the already loaded object by its
SONAME. ``torch`` and executorch's adaptor must be imported first (loading
``libQnnSystem.so`` before ``torch`` crashes the process). The Saver is the
exception: it accepts one initialization per load of its library, so what stays
loaded under its name is the Saver loader shim, which loads the real Saver
afresh for every Saver session (two Saver lowerings in one process).
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import importlib.util
import logging
import mmap
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from .. import progress

logger = logging.getLogger(__name__)

HOST_LIB_DIR = Path("lib") / "x86_64-linux-clang"
SHIM_SOURCE = Path(__file__).with_name("htp_shim.c")
# Answers to libQnnSaver.so and loads the real Saver afresh for each session (see the file).
SAVER_SHIM_SOURCE = Path(__file__).with_name("saver_shim.c")
# First QAIRT release whose HTP device custom config carries the payload at byte 8.
SHIM_FROM_VERSION = (2, 47)
# Libraries executorch opens by bare name; loaded here by absolute path.
PRELOAD_LIBS = ("libQnnHtp.so", "libQnnSystem.so", "libQnnSaver.so")
WHEEL_PACKAGE = "onnxruntime_qnn"
# Written into every root assembled here; names the wheel directory it links to.
MARKER = "qnn_convbwd_sdk.txt"


class SdkUnavailable(RuntimeError):
    """No usable QNN SDK could be found or assembled; the message says why."""


@dataclasses.dataclass(frozen=True)
class SdkInfo:
    root: Path
    source: str  # "QNN_SDK_ROOT" or "onnxruntime-qnn wheel"
    real_htp: Path  # the QAIRT libQnnHtp.so
    build_id: str
    shim: Path | None  # compiled shim, None when not needed or disabled
    shim_reason: str
    shim_build_seconds: float | None  # None when taken from the cache
    saver_shim: Path | None = None  # answers to libQnnSaver.so; None when the SDK has no Saver

    @property
    def lib_dir(self) -> Path:
        return self.root / HOST_LIB_DIR

    def version(self) -> tuple[int, int]:
        return parse_version(self.build_id)


_lock = threading.Lock()
_active: SdkInfo | None = None


def parse_version(build_id: str) -> tuple[int, int]:
    match = re.search(r"v?(\d+)\.(\d+)", build_id)
    if match is None:
        raise SdkUnavailable(f"cannot read a QAIRT version from build id {build_id!r}")
    return int(match.group(1)), int(match.group(2))


def cache_dir() -> Path:
    if os.environ.get("QNN_CONVBWD_CACHE"):
        return Path(os.environ["QNN_CONVBWD_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "qnn_convbwd"


def _wheel_lib_dir() -> Path:
    spec = importlib.util.find_spec(WHEEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SdkUnavailable(
            "QNN_SDK_ROOT is not set and the onnxruntime-qnn wheel is not installed "
            "(pip install onnxruntime-qnn==2.7.0 provides the QAIRT x86-64 libraries)"
        )
    lib_dir = Path(list(spec.submodule_search_locations)[0])
    missing = [n for n in ("libQnnHtp.so", "libQnnSystem.so") if not (lib_dir / n).exists()]
    if missing:
        raise SdkUnavailable(f"onnxruntime-qnn at {lib_dir} lacks {', '.join(missing)}")
    return lib_dir


def _fingerprint(*paths: Path) -> str:
    digest = hashlib.sha256()
    for path in paths:
        stat = path.stat()
        digest.update(f"{path.resolve()}:{stat.st_size}:{int(stat.st_mtime)}".encode())
    digest.update(SHIM_SOURCE.read_bytes())
    digest.update(SAVER_SHIM_SOURCE.read_bytes())
    return digest.hexdigest()[:16]


def _compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    raise SdkUnavailable("no C compiler (cc, gcc or clang) on PATH to build the HTP shim")


def build_shim(real_htp: Path, out: Path, payload_shift: int = 4) -> float:
    """Compile ``htp_shim.c`` against ``real_htp`` into ``out``; return seconds spent."""
    defines = [
        f'-DQNN_CONVBWD_REAL_HTP="{real_htp}"',
        f"-DQNN_CONVBWD_PAYLOAD_SHIFT={payload_shift}",
    ]
    return _compile(SHIM_SOURCE, "libQnnHtp.so", defines, out)


def build_saver_shim(real_saver: Path, out: Path) -> float:
    """Compile ``saver_shim.c`` against ``real_saver`` into ``out``; return seconds spent."""
    defines = [f'-DQNN_CONVBWD_REAL_SAVER="{real_saver}"']
    return _compile(SAVER_SHIM_SOURCE, "libQnnSaver.so", defines, out)


def _compile(source: Path, soname: str, defines: list[str], out: Path) -> float:
    import time

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = [
        _compiler(),
        "-O2",
        "-fPIC",
        "-shared",
        "-fvisibility=hidden",
        "-Wall",
        "-Wextra",
        "-Werror",
        *defines,
        f"-Wl,-soname,{soname}",
        "-Wl,-z,nodelete",
        "-o",
        str(tmp),
        str(source),
        "-ldl",
        "-lpthread",
    ]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SdkUnavailable(f"building {source.name} failed: {' '.join(cmd)}\n{proc.stderr}")
    os.replace(tmp, out)  # atomic: concurrent processes never see a half-written file
    return time.perf_counter() - start


def read_build_id(htp_library: Path) -> str:
    """QAIRT build id (``v2.51.0.260929181845``) embedded in an HTP library.

    Read from the file rather than by loading it: loading the real library before
    the shim would let it answer to the bare name ``libQnnHtp.so`` for the rest
    of the process. ``doctor`` cross-checks it against the loaded library.
    """
    with open(htp_library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        match = re.search(rb"v(\d+)\.(\d+)\.(\d+)\.(\d{6,})\x00", m)
        found = None if match is None else bytes(match.group(0)[:-1]).decode()
    if found is None:
        raise SdkUnavailable(f"{htp_library} carries no QAIRT build id")
    return found


def loaded_build_id(sdk: SdkInfo) -> str:
    """Build id as the library answering to ``libQnnHtp.so`` in this process reports it."""
    from .. import integration

    return str(integration.get("GetQnnSdkBuildId")(str(sdk.lib_dir / "libQnnHtp.so")))


def _shim_wanted(build_id: str) -> tuple[bool, str]:
    mode = os.environ.get("QNN_CONVBWD_SHIM", "auto").lower()
    if mode in ("off", "0", "no"):
        return False, "disabled by QNN_CONVBWD_SHIM=off"
    if mode in ("on", "1", "yes"):
        return True, "forced by QNN_CONVBWD_SHIM=on"
    if parse_version(build_id) >= SHIM_FROM_VERSION:
        return True, (
            f"QAIRT {build_id} >= {SHIM_FROM_VERSION[0]}.{SHIM_FROM_VERSION[1]}: HTP device "
            "config layout differs from executorch 1.5.1's"
        )
    return False, f"QAIRT {build_id} uses the device config layout executorch 1.5.1 expects"


def _link(target: Path, link: Path) -> None:
    if link.is_symlink() or link.exists():
        if link.is_symlink() and Path(os.readlink(link)) == target:
            return
        link.unlink()
    link.symlink_to(target)


def _assemble_from_wheel(build_id: str, wants_shim: bool) -> tuple[Path, Path | None, float | None]:
    wheel = _wheel_lib_dir()
    real_htp = wheel / "libQnnHtp.so"
    key = _fingerprint(real_htp, wheel / "libQnnSystem.so")
    # A root without the shim is a different root: switching QNN_CONVBWD_SHIM never
    # rewrites a root that another process may be using.
    root = cache_dir() / (f"sdk-{key}" if wants_shim else f"sdk-{key}-noshim")
    lib_dir = root / HOST_LIB_DIR
    lib_dir.mkdir(parents=True, exist_ok=True)
    for lib in wheel.glob("*.so"):
        if (lib.name == "libQnnHtp.so" and wants_shim) or lib.name == "libQnnSaver.so":
            continue
        _link(lib, lib_dir / lib.name)
    # The wheel's libraries find their C++ runtime through $ORIGIN/../onnxruntime_qnn.libs.
    libs = wheel.parent / f"{WHEEL_PACKAGE}.libs"
    if libs.is_dir():
        _link(libs, root / "lib" / libs.name)
    marker = root / MARKER
    if not marker.exists():
        marker.write_text(f"assembled by qnn_convbwd from {wheel}\n")
    shim, seconds = None, None
    if wants_shim:
        shim = lib_dir / "libQnnHtp.so"
        if shim.is_symlink():  # left by an older version that toggled the shim in place
            shim.unlink()
        if not shim.exists():
            seconds = build_shim(real_htp, shim)
            logger.info("built HTP shim %s in %.2f s", shim, seconds)
    _saver_shim(wheel / "libQnnSaver.so", lib_dir / "libQnnSaver.so")
    return root, shim, seconds


def _saver_shim(real_saver: Path, shim: Path) -> Path | None:
    """The Saver loader shim for ``real_saver`` at ``shim`` (built once); None without a Saver."""
    if not real_saver.exists():
        return None
    if shim.is_symlink():  # a link to the real Saver, left by an older version
        shim.unlink()
    if not shim.exists():
        seconds = build_saver_shim(real_saver, shim)
        logger.info("built Saver loader shim %s in %.2f s", shim, seconds)
    return shim


def _shim_for_user_sdk(real_htp: Path) -> tuple[Path, float | None]:
    key = _fingerprint(real_htp)
    shim = cache_dir() / f"shim-{key}" / "libQnnHtp.so"
    seconds = None if shim.exists() else build_shim(real_htp, shim)
    return shim, seconds


def is_assembled_root(root: Path) -> bool:
    """True when ``root`` was assembled by this module (it carries ``MARKER``)."""
    return (root / MARKER).is_file()


def _import_torch_and_adaptor() -> None:
    # Order matters: torch before any QNN library, the adaptor before the preloads.
    import executorch.backends.qualcomm.python.PyQnnManagerAdaptor  # noqa: F401
    import torch  # noqa: F401


def _preload(paths: list[Path]) -> None:
    for path in paths:
        if path.exists():
            ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)


def _prepend_env(name: str, value: str) -> None:
    parts = [p for p in os.environ.get(name, "").split(os.pathsep) if p]
    if value not in parts:
        os.environ[name] = os.pathsep.join([value, *parts])


# The environment variables ensure_sdk sets for a root it assembled (a user's
# QNN_SDK_ROOT leaves the environment as it is).
ENVIRONMENT = ("QNN_SDK_ROOT", "LD_LIBRARY_PATH")


# Read by the HTP shim at each graph creation: the finalize optimization level
# (htp_shim.c). Set by request_htp_optimization, never by ensure_sdk.
OPTIMIZATION_VARIABLE = "QNN_CONVBWD_HTP_OPTIMIZATION"
EXECUTORCH_OPTIMIZATION = 3  # what executorch 1.5.1's host build asks for
_optimization_requested = False


def request_htp_optimization(level: int) -> None:
    """Have the HTP shim finalize the graphs compiled next at ``level`` (2 or 3; the
    shim also takes 1, which QAIRT 2.51 miscompiles with: docs/htp_defects.md).

    Executorch's own level (3) removes the variable again if this function set it;
    a value the user exported is then left alone.
    """
    global _optimization_requested
    with _lock:
        if level == EXECUTORCH_OPTIMIZATION:
            if _optimization_requested:
                os.environ.pop(OPTIMIZATION_VARIABLE, None)
                _optimization_requested = False
            return
        if _active is not None and _active.shim is None:
            logger.warning(
                "htp_optimization=%d needs the HTP shim, which is not in use (%s): "
                "executorch's level %d stays",
                level,
                _active.root,
                EXECUTORCH_OPTIMIZATION,
            )
            return
        os.environ[OPTIMIZATION_VARIABLE] = str(level)
        _optimization_requested = True


def _export(info: SdkInfo) -> None:
    """For executorch (skips its SDK download) and for child processes."""
    if info.source == "QNN_SDK_ROOT":
        return
    os.environ["QNN_SDK_ROOT"] = str(info.root)
    _prepend_env("LD_LIBRARY_PATH", str(info.lib_dir))


def ensure_sdk() -> SdkInfo:
    """Make a QNN SDK usable in this process (idempotent); raise SdkUnavailable if impossible.

    Also (again) exports ``ENVIRONMENT`` for a root assembled from the wheel, in case
    it was restored since (``qnn_convbwd.disable()``)."""
    global _active
    with _lock:
        if _active is not None:
            _export(_active)
            return _active
        _import_torch_and_adaptor()
        user_root = os.environ.get("QNN_SDK_ROOT")
        if user_root and is_assembled_root(Path(user_root)):
            # Inherited from a parent that ran ensure_sdk(): assemble (or reuse) again.
            user_root = None
        if user_root:
            root = Path(user_root)
            real_htp = root / HOST_LIB_DIR / "libQnnHtp.so"
            if not real_htp.exists():
                raise SdkUnavailable(f"QNN_SDK_ROOT={root} has no {HOST_LIB_DIR}/libQnnHtp.so")
            build_id = read_build_id(real_htp)
            wants, reason = _shim_wanted(build_id)
            shim, seconds = _shim_for_user_sdk(real_htp) if wants else (None, None)
            saver = _saver_shim(
                root / HOST_LIB_DIR / "libQnnSaver.so",
                cache_dir() / f"saver-{_fingerprint(real_htp)}" / "libQnnSaver.so",
            )
            info = SdkInfo(root, "QNN_SDK_ROOT", real_htp, build_id, shim, reason, seconds, saver)
        else:
            wheel_htp = _wheel_lib_dir() / "libQnnHtp.so"
            build_id = read_build_id(wheel_htp)
            wants, reason = _shim_wanted(build_id)
            root, shim, seconds = _assemble_from_wheel(build_id, wants)
            saver = root / HOST_LIB_DIR / "libQnnSaver.so"
            info = SdkInfo(
                root,
                "onnxruntime-qnn wheel",
                wheel_htp,
                build_id,
                shim,
                reason,
                seconds,
                saver if saver.exists() else None,
            )
            _export(info)
        # A shim stands in for its library; the real Saver is never kept loaded (a loaded
        # Saver cannot be initialized twice), so without its shim it is not preloaded.
        stand_ins = {"libQnnHtp.so": info.shim, "libQnnSaver.so": info.saver_shim}
        preload = [
            stand_ins.get(name) or info.lib_dir / name
            for name in PRELOAD_LIBS
            if name != "libQnnSaver.so" or info.saver_shim is not None
        ]
        _preload(preload)
        logger.info(
            "QNN SDK %s (%s), QAIRT %s, HTP shim: %s (%s)",
            info.root,
            info.source,
            info.build_id,
            info.shim or "not used",
            info.shim_reason,
        )
        _active = info
        return info


def active_sdk() -> SdkInfo | None:
    return _active


@progress.long_call("checking in a child process")
def probe_in_subprocess(code: str, timeout: float = 600.0) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter that calls ensure_sdk() first."""
    prelude = "import qnn_convbwd.toolchain.sdk as s; s.ensure_sdk()\n"
    with tempfile.TemporaryDirectory(prefix="qnn_convbwd_probe_") as cwd:
        return subprocess.run(
            [sys.executable, "-c", prelude + code],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd,
        )


def describe(info: SdkInfo) -> str:
    """One line per fact about ``info`` (used by ``qnn-convbwd doctor``)."""
    if info.shim is None:
        shim = f"not used ({info.shim_reason})"
    else:
        how = (
            "cached"
            if info.shim_build_seconds is None
            else f"built in {info.shim_build_seconds:.2f} s"
        )
        shim = f"{info.shim} ({how}; {info.shim_reason})"
    return "\n".join(
        [
            f"QNN SDK root: {info.root} (from {info.source})",
            f"QAIRT build id: {info.build_id} (read from {info.real_htp})",
            f"HTP shim: {shim}",
        ]
    )
