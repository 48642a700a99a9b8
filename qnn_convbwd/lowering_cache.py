"""Whole lowerings kept on disk: ``lower()`` of a program it lowered before returns
the stored outcome instead of lowering again.

The context-binary cache (context_cache.py) skips QAIRT's finalisation only; the
export passes, the partitioner and the build of the QNN graphs still run, 10-90 s
for a zoo training graph. This cache keeps ``lower()``'s outcome: the edge program
with its delegates (in executorch's serialisation of edge programs) and the report.
Its key (``key_parts``) digests everything ``lower()`` reads:

* the input program: its graph (``context_cache.program_digest``: targets,
  arguments, shapes and dtypes, and the bytes of every parameter, buffer and
  constant), every node's name and module path, its signature (the kind and target
  of every input and output) and its range constraints;
* the compile specs and the ``skip_node_id_set`` / ``skip_node_op_set`` of the call;
* the plugin (version, a digest of its sources, its options), QAIRT, the SDK's
  libraries, executorch and torch.

An entry is stored only once the program read back from its bytes emits the same
``.pte`` as the program lowered. Executorch's serialisation drops tensor and node
attributes; the two the plugin's programs depend on are saved beside the program and
put back on a read: which parameters require a gradient, and which buffers are
marked ``et_init_buffer`` (their initial values are part of the ``.pte``). A program
that still emits other bytes is not stored, and the log says so.

Entries live beside the context binaries (``context_cache.directory()``) in the same
file format, under the same size bound and least-recently-used eviction, with the
same checks on a read: a corrupt or mismatched entry is deleted and the program
lowered again. ``lowering_cache=False`` turns this cache off, and the context cache's
switch both (``context_cache=False``, ``QNN_CONVBWD_CONTEXT_CACHE=0``). The Saver
always lowers.

A program with dropout lowered without a ``dropout_seed`` draws its seed from
torch's RNG: ``lower()`` draws it before the key is made, as the dropout pass would,
so the key holds it and torch's RNG advances the same with or without a hit.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from . import context_cache, integration, options, progress

logger = logging.getLogger(__name__)

KIND = "program"  # the ``about["kind"]`` of an entry (context binaries have none)
_EXTRA = "qnn_convbwd.json"  # the entry's own record, an extra file of the saved program


@dataclasses.dataclass(frozen=True)
class Stored:
    """A lowering read back from the cache."""

    edge: Any  # executorch's EdgeProgramManager
    report: dict  # what ``store`` was given as the report
    key: str


def _signature(program: torch.export.ExportedProgram) -> list:
    sig = program.graph_signature
    return [repr(spec) for spec in (*sig.input_specs, *sig.output_specs)]


def _node_names(program: torch.export.ExportedProgram) -> list:
    return [
        [node.name, sorted(str(v) for v in (node.meta.get("nn_module_stack") or {}).values())]
        for node in program.graph.nodes
    ]


def key_parts(
    program: torch.export.ExportedProgram,
    compile_specs: Sequence[Any],
    skips: Iterable[Any],
) -> dict:
    """Everything the key digests, by name."""
    plugin_options = {
        k: v
        for k, v in dataclasses.asdict(options.current).items()
        if k not in context_cache.CACHE_OPTIONS
    }
    return {
        "format": context_cache.FORMAT,
        "kind": KIND,
        "plugin": context_cache.plugin_identity(),
        "options": repr(sorted(plugin_options.items())),
        **context_cache.toolchain(),
        "torch": torch.__version__,
        "compile_specs": [[s.key, context_cache.sha(bytes(s.value))] for s in compile_specs],
        "skips": [sorted(map(str, s)) if s else None for s in skips],
        "program": context_cache.program_digest(program),
        "names": context_cache.sha(json.dumps(_node_names(program)).encode()),
        "signature": _signature(program),
        "range_constraints": repr(sorted(map(repr, program.range_constraints.items()))),
    }


def usable(compile_specs: Sequence[Any]) -> bool:
    """Whether ``lower()`` goes through this cache: it is on, the backend is no Saver,
    and nobody observes what a lowering builds (``integration.capture_qnn_graphs``,
    ``passes.conv_batch_norm.observe_folds``: a hit would build nothing for them)."""
    from .partition.target import Target
    from .passes import conv_batch_norm

    return (
        context_cache.enabled()
        and options.current.lowering_cache
        and not Target.from_compile_specs(list(compile_specs)).saver
        and not integration.capturing_qnn_graphs()
        and not conv_batch_norm.folds_observed()
    )


# --- an entry's bytes --------------------------------------------------------------


def _values(node: torch.fx.Node) -> list:
    value = node.meta.get("val")
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _restorable(program: torch.export.ExportedProgram) -> dict:
    """What executorch's serialisation drops and the ``.pte`` depends on."""
    return {
        "requires_grad": sorted(
            name
            for name, value in program.state_dict.items()
            if isinstance(value, torch.Tensor) and value.requires_grad
        ),
        "values_requiring_grad": {
            node.name: [i for i, v in enumerate(_values(node)) if getattr(v, "requires_grad", 0)]
            for node in program.graph.nodes
            if any(getattr(v, "requires_grad", False) for v in _values(node))
        },
        "init_buffers": sorted(
            node.name
            for node in program.graph.nodes
            if node.op == "placeholder" and node.meta.get("et_init_buffer")
        ),
    }


def _restore(program: torch.export.ExportedProgram, record: dict) -> None:
    for name in record["requires_grad"]:
        value = program.state_dict[name]
        program.state_dict[name] = torch.nn.Parameter(value.detach(), requires_grad=True)
    by_name = {n.name: n for n in program.graph.nodes}
    for name, indices in record["values_requiring_grad"].items():
        values = _values(by_name[name])
        for i in indices:
            values[i].requires_grad_(True)
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    for name in record["init_buffers"]:
        placeholders[name].meta["et_init_buffer"] = True


def encode(edge: Any, report: dict) -> bytes:
    if edge.config_methods or edge.methods != {"forward"}:
        raise ValueError("a program with constant methods or several methods")
    program = edge.exported_program()
    record = {"report": report, **_restorable(program)}
    buffer = io.BytesIO()
    integration.get("save")(program, buffer, extra_files={_EXTRA: json.dumps(record)})
    return buffer.getvalue()


def decode(data: bytes) -> tuple[Any, dict]:
    """(EdgeProgramManager, report) of an entry's bytes."""
    extra = {_EXTRA: ""}
    program = integration.get("load")(io.BytesIO(data), extra_files=extra)
    record = json.loads(extra[_EXTRA])
    _restore(program, record)
    manager = integration.get("EdgeProgramManager")(
        {"forward": program}, compile_config=integration.get("qnn_edge_config")()
    )
    return manager, record["report"]


def _emitted(edge: Any) -> bytes:
    """The ``.pte`` of ``edge`` as a training program emits it."""
    from executorch.exir import ExecutorchBackendConfig

    config = ExecutorchBackendConfig(emit_mutable_buffer_names=True)
    return bytes(edge.to_executorch(config).buffer)


def _about(edge: Any, compile_specs: Sequence[Any]) -> dict:
    from .partition.target import Target

    target = Target.from_compile_specs(list(compile_specs))
    graph = edge.exported_program().graph
    calls = [
        n for n in graph.nodes if getattr(n.target, "__name__", "") == "executorch_call_delegate"
    ]
    return {
        "kind": KIND,
        "soc": target.soc,
        "htp_arch": target.htp_arch,
        "delegates": len(calls),
        "ops": sum(n.op == "call_function" for n in graph.nodes) - len(calls),
    }


# --- the hook ----------------------------------------------------------------------


def lookup(key_: str) -> Stored | None:
    """The stored lowering for ``key_``, or None (an entry that cannot be read back is
    deleted)."""
    data = context_cache.load(key_)
    if data is None:
        return None
    try:
        edge, report = decode(data)
    except Exception as err:  # an entry of bytes that passed the checksum yet do not load
        logger.warning("lowering cache: entry %s does not load (%s); deleted", key_[:16], err)
        (context_cache.directory() / f"{key_}{context_cache.SUFFIX}").unlink(missing_ok=True)
        return None
    return Stored(edge, report, key_)


def store(key_: str, edge: Any, report: dict, compile_specs: Sequence[Any]) -> bool:
    """Keep ``edge`` and ``report`` under ``key_`` if the program read back from the
    entry emits the same ``.pte``; whether it was stored."""
    started = time.perf_counter()
    try:
        data = encode(edge, report)
        again, _ = decode(data)
        same = _emitted(again) == _emitted(copy.deepcopy(edge))
    except Exception as err:  # what executorch cannot serialise is lowered every time
        logger.info("lowering cache: not stored (%s: %s)", type(err).__name__, err)
        return False
    if not same:
        logger.warning(
            "lowering cache: the program read back emits another .pte than the one "
            "lowered; not stored"
        )
        return False
    context_cache.store(
        key_, data, _about(edge, compile_specs), limit=options.current.context_cache_bytes
    )
    logger.info(
        "lowering cache: stored %s (%d bytes, checked in %.1f s)",
        key_[:16],
        len(data),
        time.perf_counter() - started,
    )
    return True


def through(
    program: torch.export.ExportedProgram,
    compile_specs: Sequence[Any],
    skips: Iterable[Any],
    lower: Callable[[], tuple[Any, Any]],
    record: Callable[[Any], dict],
    restore: Callable[[dict], Any],
) -> tuple[Any, Any]:
    """(edge, report) of ``lower()``, or of the entry that stored it before; ``record``
    makes a report JSON data, ``restore`` the report again."""
    if not usable(compile_specs):
        return lower()
    started = time.perf_counter()
    try:
        key_ = context_cache.key(key_parts(program, compile_specs, list(skips)))
    except Exception as err:  # a program the key cannot digest is lowered, not cached
        logger.warning("lowering cache: no key for this program (%s: %s)", type(err).__name__, err)
        return lower()
    found = lookup(key_)
    if found is not None:
        progress.phase(progress.CACHE_HIT)
        logger.info(
            "lowering cache: hit %s (read in %.2f s)", key_[:16], time.perf_counter() - started
        )
        return found.edge, restore(found.report)
    edge, report = lower()
    try:
        data = record(report)
    except Exception as err:  # symbolic sizes of a dynamic program are no JSON data
        logger.info("lowering cache: not stored (report: %s: %s)", type(err).__name__, err)
    else:
        store(key_, edge, data, compile_specs)
    return edge, report
