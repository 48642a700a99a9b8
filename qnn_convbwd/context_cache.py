"""A cache of QNN context binaries: lowering the same QNN graph again reuses its binary.

QAIRT's finalisation of a QNN graph into a context binary is most of a lowering's
time. ``compile`` stands in for the QNN manager's ``Compile`` (integration patches
it in): it digests everything that decides the binary into a key, returns a stored
binary for that key, or compiles and stores one.

The key (``key_parts``) covers:

* the QNN graph as built: every op's name, type, package, scalar parameters and
  tensor parameters' names, and every tensor's type, data type, shape and
  quantization parameters, tensors and ops named by their order of first
  appearance (``_Names``), graph inputs and outputs with their role prefix
  (executorch's op wrappers expose neither the data of static tensors nor the
  values of tensor parameters, hence the next item);
* the delegate's edge program: its graph (targets, arguments, output shapes and
  dtypes; its inputs by name, other nodes by order) and the bytes of every
  constant, parameter and buffer it holds: the source of every static tensor's
  values and every tensor parameter;
* the compile specs (SoC, HTP architecture, precision, every backend option), the
  HTP finalisation level the shim applies, the QAIRT build id and the SDK's
  libraries (shim included), the executorch version, and the plugin: its version,
  a digest of its source files and its options.

An entry is one file ``<key>.ctx``: a header (its key, the binary's size and
SHA-256, what it holds) and the binary. A read checks all of them; a corrupt,
truncated or mismatched entry is logged, deleted and rebuilt, never used. Writes
go to a temporary file renamed into place. The total size is bounded: the least
recently used entries are deleted first.

Off with the ``context_cache=False`` option or ``QNN_CONVBWD_CONTEXT_CACHE=0``;
the Saver (which records QNN API calls while compiling) always compiles.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from . import options, progress

logger = logging.getLogger(__name__)

ENV_SWITCH = "QNN_CONVBWD_CONTEXT_CACHE"  # "0", "off", "false" or "no": no cache
MAGIC = b"QNNCTX01"
SUFFIX = ".ctx"
FORMAT = 1  # bumped when the key or the entry layout changes
_HEADER_LEN_BYTES = 4
# Options that do not change the binary (where and how much to cache, how many at once).
CACHE_OPTIONS = (
    "context_cache",
    "context_cache_dir",
    "context_cache_bytes",
    "lowering_cache",
    "finalize_workers",
)


def default_dir() -> Path:
    """``<cache>/contexts``: ``$QNN_CONVBWD_CACHE``, else ``~/.cache/qnn_convbwd``."""
    from .toolchain.sdk import cache_dir

    return cache_dir() / "contexts"


def directory() -> Path:
    return Path(options.current.context_cache_dir or default_dir())


def enabled() -> bool:
    if os.environ.get(ENV_SWITCH, "").strip().lower() in ("0", "off", "false", "no"):
        return False
    return options.current.context_cache


# --- the key ---------------------------------------------------------------------


def _tensor_bytes(tensor: Any) -> bytes:
    flat = tensor.detach().contiguous().reshape(-1)
    import torch

    return flat.view(torch.uint8).numpy().tobytes()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _quant(tensor_v2: Any) -> list:
    params = tensor_v2.quantizeParams
    parts: list = [str(params.encodingDefinition), str(params.quantizationEncoding)]
    encoding = str(params.quantizationEncoding)
    if encoding.endswith("_SCALE_OFFSET") and "AXIS" not in encoding:
        so = params.scaleOffsetEncoding
        parts += [float(so.scale), int(so.offset)]
    elif "AXIS_SCALE_OFFSET" in encoding:
        axis = params.axisScaleOffsetEncoding
        parts += [int(axis.axis), int(axis.numScaleOffsets)]
        parts += [[float(s.scale), int(s.offset)] for s in axis.scaleOffset]
    return parts


class _Names:
    """Names by their order of first appearance: executorch names the ops and tensors
    it inserts from counters that run on within a process, so one program lowered
    twice in a process gets other names. What a name tells the runtime is kept:
    the role prefix of a graph input or output (``input_<i>_``, ``output_``,
    ``mutbuf_``), by which the delegate binds its arguments in the graph's order.
    Program inputs (placeholders) keep their names."""

    _ROLE = re.compile(r"^(?:input_\d+_|output_|mutbuf_)")

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}

    def __call__(self, name: str, public: bool) -> str:
        ordinal = self._seen.setdefault(name, len(self._seen))
        if not public:
            return f"#{ordinal}"
        role = self._ROLE.match(name)
        return f"{role.group(0) if role else ''}#{ordinal}"


def _tensor(tensor: Any, names: _Names) -> list:
    v2 = tensor.v2
    kind = str(v2.type)
    return [
        names(str(v2.name), public="APP_" in kind),
        kind,
        str(v2.dataType),
        [int(d) for d in v2.dimensions],
        _quant(v2),
    ]


def _param(param: Any) -> list:
    kind = str(param.paramType)
    if kind.endswith("TENSOR"):
        # executorch's getter yields an empty tensor for a tensor parameter: its values
        # (strides, pads, permutations) come from the program's graph, digested there.
        return [str(param.name), kind]
    scalar = param.scalarParam
    value = scalar.value() if callable(scalar.value) else scalar.value
    return [str(param.name), kind, str(scalar.dataType), repr(value)]


def qnn_graph_digest(op_wrappers: Sequence[Any]) -> str:
    """Digest of a QNN graph's ops (``OpWrapper`` objects, in compile order)."""
    digest = hashlib.sha256()
    names = _Names()
    for op in op_wrappers:
        config = op.GetOpConfig()
        entry = [
            str(config["packageName"]),
            str(config["typeName"]),
            [_param(p) for p in config["params"]],
            [_tensor(t, names) for t in config["inputTensors"]],
            [_tensor(t, names) for t in config["outputTensors"]],
        ]
        digest.update(json.dumps(entry).encode())
    return digest.hexdigest()


def _argument(value: Any, names: _Names) -> Any:
    import torch

    if isinstance(value, torch.fx.Node):
        return value.name if value.op == "placeholder" else names(value.name, public=False)
    if isinstance(value, (list, tuple)):
        return [_argument(v, names) for v in value]
    if isinstance(value, dict):
        return {str(k): _argument(v, names) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        return f"tensor:{value.dtype}:{list(value.shape)}:{sha(_tensor_bytes(value))}"
    return repr(value)


def _value_meta(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_value_meta(v) for v in value]
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if not dtype:
        return repr(value)
    # A dynamic program's sizes are symbols (``s0``): named, with the range constraints.
    sizes = [d if isinstance(d, int) else str(d) for d in shape] if shape is not None else None
    return [sizes, str(dtype)]


def program_digest(program: Any) -> str:
    """Digest of a delegate's edge program: its graph (inputs by name, other nodes by
    order) and the bytes of its tensors."""
    digest = hashlib.sha256()
    names = _Names()
    for node in program.graph_module.graph.nodes:
        target = node.target if isinstance(node.target, str) else str(node.target)
        entry = [
            node.op,
            _argument(node, names),
            target if node.op != "get_attr" else "get_attr",
            _argument(node.args, names),
            _argument(node.kwargs, names),
            _value_meta(node.meta.get("val")),
        ]
        digest.update(json.dumps(entry).encode())
    tensors = {**dict(program.state_dict), **dict(getattr(program, "constants", {}))}
    for name in sorted(tensors):
        value = tensors[name]
        if hasattr(value, "dtype") and hasattr(value, "shape"):
            digest.update(f"{name}:{value.dtype}:{list(value.shape)}".encode())
            digest.update(_tensor_bytes(value))
        else:
            digest.update(f"{name}:{type(value).__name__}".encode())
    for node in program.graph_module.graph.nodes:
        if node.op == "get_attr":
            value = getattr(program.graph_module, node.target, None)
            if hasattr(value, "dtype") and hasattr(value, "shape"):
                digest.update(_tensor_bytes(value))
    return digest.hexdigest()


def plugin_identity() -> str:
    from . import __version__

    return f"{__version__}+{_source_digest()}"


_source_digest_value: str | None = None


def _source_digest() -> str:
    """Digest of the plugin's source files: a changed visitor or pass is a new key."""
    global _source_digest_value
    if _source_digest_value is None:
        root = Path(__file__).resolve().parent
        digest = hashlib.sha256()
        for path in sorted((*root.rglob("*.py"), *root.rglob("*.c"))):
            digest.update(path.relative_to(root).as_posix().encode())
            digest.update(path.read_bytes())
        _source_digest_value = digest.hexdigest()
    return _source_digest_value


def toolchain() -> dict:
    from . import integration
    from .toolchain.sdk import OPTIMIZATION_VARIABLE, active_sdk, loaded_build_id

    info = active_sdk()
    return {
        "qairt": loaded_build_id(info) if info else None,
        "sdk_root": str(info.root) if info else None,
        "htp_library": str(info.real_htp) if info else None,
        "htp_shim": str(info.shim) if info and info.shim else None,
        "htp_optimization": os.environ.get(OPTIMIZATION_VARIABLE, "executorch's"),
        "executorch": integration.executorch_version(),
    }


def key_parts(
    compile_specs: Sequence[Any],
    graph_names: Sequence[str],
    op_wrapper_lists: Sequence[Sequence[Any]],
    programs: Sequence[Any],
) -> dict:
    """Everything the key digests, by name (``key`` hashes it)."""
    plugin_options = {
        k: v for k, v in dataclasses.asdict(options.current).items() if k not in CACHE_OPTIONS
    }
    return {
        "format": FORMAT,
        "plugin": plugin_identity(),
        "options": repr(sorted(plugin_options.items())),
        **toolchain(),
        "compile_specs": [[spec.key, sha(bytes(spec.value))] for spec in compile_specs],
        "graph_names": list(graph_names),
        "qnn_graphs": [qnn_graph_digest(ops) for ops in op_wrapper_lists],
        "programs": [program_digest(p) for p in programs],
    }


def key(parts: dict) -> str:
    return sha(json.dumps(parts, sort_keys=True).encode())


# --- entries on disk -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Entry:
    path: Path
    key: str
    size: int  # bytes of the file
    binary_size: int
    created: float
    last_used: float
    about: dict  # what the binary holds (SoC, graphs, op count)


class CorruptEntry(ValueError):
    pass


def _parse(path: Path, data: bytes) -> tuple[dict, bytes]:
    """(header, binary) of an entry's bytes; CorruptEntry says what is wrong."""
    if not data.startswith(MAGIC):
        raise CorruptEntry("not a context cache entry (bad magic)")
    start = len(MAGIC) + _HEADER_LEN_BYTES
    if len(data) < start:
        raise CorruptEntry("truncated header")
    length = int.from_bytes(data[len(MAGIC) : start], "big")
    try:
        header = json.loads(data[start : start + length].decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptEntry(f"unreadable header ({err})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise CorruptEntry(f"header of another format ({str(header)[:80]})")
    binary = data[start + length :]
    if len(binary) != header.get("size"):
        raise CorruptEntry(f"binary of {len(binary)} bytes, header says {header.get('size')}")
    if sha(binary) != header.get("sha256"):
        raise CorruptEntry("binary checksum mismatch")
    if path.name != f"{header.get('key')}{SUFFIX}":
        raise CorruptEntry(f"stored under the wrong key (header key {header.get('key')})")
    return header, binary


def load(key_: str, root: Path | None = None) -> bytes | None:
    """The stored binary for ``key_``, or None (a bad entry is deleted)."""
    path = (root or directory()) / f"{key_}{SUFFIX}"
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as err:
        logger.warning("context cache: cannot read %s (%s); compiling", path, err)
        return None
    try:
        _, binary = _parse(path, data)
    except CorruptEntry as err:
        logger.warning("context cache: %s: %s; deleted, compiling again", path, err)
        path.unlink(missing_ok=True)
        return None
    now = time.time()
    with contextlib.suppress(OSError):
        os.utime(path, (now, now))  # the LRU order is the files' modification time
    return binary


def store(key_: str, binary: bytes, about: dict, root: Path | None = None, limit: int = 0) -> None:
    """Write an entry atomically, then evict least recently used entries above ``limit``."""
    root = root or directory()
    header = {
        "format": FORMAT,
        "key": key_,
        "size": len(binary),
        "sha256": sha(binary),
        "created": time.time(),
        "about": about,
    }
    head = json.dumps(header).encode()
    total = len(MAGIC) + _HEADER_LEN_BYTES + len(head) + len(binary)
    if limit and total > limit:
        logger.info(
            "context cache: a %d-byte binary exceeds the %d-byte bound; not stored", total, limit
        )
        return
    temporary = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".tmp-", delete=False) as tmp:
            temporary = tmp.name
            tmp.write(MAGIC + len(head).to_bytes(_HEADER_LEN_BYTES, "big") + head + binary)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.replace(temporary, root / f"{key_}{SUFFIX}")
    except OSError as err:
        logger.warning("context cache: cannot write to %s (%s); not stored", root, err)
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
        return
    if limit:
        evict(limit, root, keep=key_)


def entries(root: Path | None = None) -> list[Entry]:
    """The entries under ``root``, least recently used first (headers read, not checked)."""
    root = root or directory()
    found = []
    for path in root.glob(f"*{SUFFIX}") if root.is_dir() else ():
        try:
            stat = path.stat()
            with path.open("rb") as f:
                prefix = f.read(len(MAGIC) + _HEADER_LEN_BYTES)
                length = int.from_bytes(prefix[len(MAGIC) :], "big")
                header = json.loads(f.read(length).decode()) if prefix.startswith(MAGIC) else {}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            header, stat = {}, path.stat() if path.exists() else None
        if stat is None:
            continue
        found.append(
            Entry(
                path=path,
                key=path.name[: -len(SUFFIX)],
                size=stat.st_size,
                binary_size=int(header.get("size", 0)) if isinstance(header, dict) else 0,
                created=float(header.get("created", stat.st_mtime)) if header else stat.st_mtime,
                last_used=stat.st_mtime,
                about=header.get("about", {}) if isinstance(header, dict) else {},
            )
        )
    return sorted(found, key=lambda e: e.last_used)


def evict(limit: int, root: Path | None = None, keep: str | None = None) -> list[Path]:
    """Delete least recently used entries until the total is at most ``limit`` bytes."""
    listed = entries(root)
    total = sum(e.size for e in listed)
    removed = []
    for entry in listed:
        if total <= limit:
            break
        if entry.key == keep:
            continue
        with contextlib.suppress(OSError):
            entry.path.unlink()
            removed.append(entry.path)
            total -= entry.size
            logger.info("context cache: evicted %s (%d bytes)", entry.path.name, entry.size)
    return removed


def clear(root: Path | None = None) -> int:
    """Delete every entry (and stray temporary files); return how many entries."""
    root = root or directory()
    count = 0
    for path in (*root.glob(f"*{SUFFIX}"), *root.glob(".tmp-*")) if root.is_dir() else ():
        with contextlib.suppress(OSError):
            path.unlink()
            count += path.suffix == SUFFIX
    return count


# --- the hook --------------------------------------------------------------------


def _about(compile_specs: Sequence[Any], graph_names: Sequence[str], op_wrapper_lists) -> dict:
    from .partition.target import Target

    target = Target.from_compile_specs(list(compile_specs))
    return {
        "soc": target.soc,
        "htp_arch": target.htp_arch,
        "graphs": list(graph_names),
        "ops": sum(len(ops) for ops in op_wrapper_lists),
    }


def compile_through_cache(
    original: Callable[[Any, Any], Any],
    compile_specs: Sequence[Any],
    graph_names: Sequence[str],
    op_wrapper_lists: Sequence[Sequence[Any]],
    programs: Sequence[Any],
) -> Any:
    """The context binary for these QNN graphs: from the cache, or ``original``'s."""
    from .partition.target import Target

    if not enabled() or Target.from_compile_specs(list(compile_specs)).saver:
        progress.phase(progress.FINALIZE)
        return original(graph_names, op_wrapper_lists)
    started = time.perf_counter()
    key_ = key(key_parts(compile_specs, graph_names, op_wrapper_lists, programs))
    digest_seconds = time.perf_counter() - started
    binary = load(key_)
    if binary is not None:
        logger.info("context cache: hit %s (key in %.2f s)", key_[:16], digest_seconds)
        progress.phase(progress.CACHE_HIT)
        return binary
    progress.phase(progress.FINALIZE)
    compiled = original(graph_names, op_wrapper_lists)
    data = bytes(compiled)
    if data:
        about = _about(compile_specs, graph_names, op_wrapper_lists)
        store(key_, data, about, limit=options.current.context_cache_bytes)
        logger.info(
            "context cache: stored %s (%d bytes; key in %.2f s)",
            key_[:16],
            len(data),
            digest_seconds,
        )
    return compiled
