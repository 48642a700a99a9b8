"""Public entry points: enable / disable / enabled, and lower() with its report."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import operator
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch

from . import integration, logs, lowering_cache, nodes, options, pipeline, progress
from .geometry import conv as geo
from .nodes import origins
from .partition import cpu_kernel, judge
from .partition.target import Target
from .partition.verdict import Fallback
from .passes import dropout

logger = logging.getLogger(__name__)

_state_lock = threading.Lock()


# --- public API -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SideEffects:
    """What ``enable()`` did to the process, and what ``disable()`` reverts.

    Reverted by ``disable()``: executorch's patches (``patches`` of them) and the
    environment variables in ``environment`` (name -> (before, after)), restored to
    their previous values unless something else changed them since. Not reverted:
    the QNN libraries loaded into the process (``sdk_root``'s, the HTP shim), the
    SDK root and shim built in the cache directory (reused by the next process),
    and executorch's loggers handed back to the application's logging.
    """

    sdk_root: str | None  # None: no usable SDK (partitioning works, compiling does not)
    sdk_source: str | None  # "QNN_SDK_ROOT" (the user's) or "onnxruntime-qnn wheel"
    htp_shim: str | None  # the compiled HTP shim loaded in place of libQnnHtp.so
    environment: dict[str, tuple[str | None, str]]
    patches: int

    def summary(self) -> str:
        env = ", ".join(f"{name}={after}" for name, (_, after) in self.environment.items())
        sdk = f"{self.sdk_root} ({self.sdk_source})" if self.sdk_root else "none"
        return (
            f"qnn_convbwd enabled: {self.patches} executorch patches; QNN SDK {sdk}; "
            f"HTP shim {self.htp_shim or 'not used'}; environment: {env or 'unchanged'}"
        )


_side_effects: SideEffects | None = None


def enable(**overrides: Any) -> SideEffects:
    """Make executorch's Qualcomm flow lower convolution_backward (idempotent).

    Also makes a QNN SDK usable in this process when one can be found or
    assembled (see ``qnn_convbwd.toolchain``): that may assemble an SDK root in
    the cache directory, compile the HTP shim, load the QNN libraries and set
    ``QNN_SDK_ROOT`` / ``LD_LIBRARY_PATH``. Returns what it did (``SideEffects``,
    also ``side_effects()``), logged as one INFO line. ``overrides`` set fields of
    ``qnn_convbwd.options.Options``.
    """
    global _side_effects
    from .toolchain import SdkUnavailable, ensure_sdk
    from .toolchain.sdk import ENVIRONMENT

    with _state_lock:
        before = {name: os.environ.get(name) for name in ENVIRONMENT}
        try:
            info = ensure_sdk()
        except SdkUnavailable as err:
            logger.warning("no usable QNN SDK (%s); partitioning works, compiling will not", err)
            info = None
        options.update(**overrides)
        was_installed = integration.installed()
        integration.install(pipeline.hooks())
        logs.quiet_libraries()  # after install: executorch's modules are imported now
        if was_installed and _side_effects is not None:
            return _side_effects
        changed = {
            name: (value, os.environ[name])
            for name, value in before.items()
            if os.environ.get(name) is not None and os.environ.get(name) != value
        }
        _side_effects = SideEffects(
            sdk_root=str(info.root) if info else None,
            sdk_source=info.source if info else None,
            htp_shim=str(info.shim) if info and info.shim else None,
            environment=changed,
            patches=integration.patch_count(),
        )
        logger.info(_side_effects.summary())
        return _side_effects


def side_effects() -> SideEffects | None:
    """What the current ``enable()`` did (None when not enabled)."""
    return _side_effects if integration.installed() else None


def disable() -> None:
    """Restore executorch exactly as it was before enable(), and the environment
    variables enable() set (``SideEffects``)."""
    global _side_effects
    from .toolchain.sdk import EXECUTORCH_OPTIMIZATION, request_htp_optimization

    with _state_lock:
        integration.uninstall()
        options.current = options.Options()
        request_htp_optimization(EXECUTORCH_OPTIMIZATION)
        if _side_effects is not None:
            for name, (value, after) in _side_effects.environment.items():
                if os.environ.get(name) != after:
                    continue  # changed since by someone else: theirs now
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            _side_effects = None


def is_enabled() -> bool:
    return integration.installed()


@contextlib.contextmanager
def enabled(**overrides: Any) -> Iterator[None]:
    """``with qnn_convbwd.enabled(): ...`` enables for the block; restores the prior state."""
    was = is_enabled()
    before = options.current
    enable(**overrides)
    try:
        yield
    finally:
        if was:
            options.current = before
        else:
            disable()


# --- lower() and its report ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ReportRow:
    node: str
    grad_output: list
    input: list
    weight: list
    stride: list
    padding: list
    dilation: list
    groups: int
    output_mask: list
    delegated: bool
    reason: str
    # Why executorch's CPU kernel cannot execute the node, which stays on CPU
    # (e.g. "3-D"); None when it is delegated or the CPU kernel runs it.
    cpu_refusal: str | None = None

    @property
    def summary(self) -> str:
        """``reason``, plus what staying on CPU means when the CPU kernel refuses the node."""
        if self.cpu_refusal is None:
            return self.reason
        return (
            f"{self.reason}; stays on CPU, where executorch's CPU kernel cannot execute it "
            f"({self.cpu_refusal})"
        )


@dataclasses.dataclass(frozen=True)
class CpuOp:
    """An op kept on CPU, with the rule that kept it there and its reason."""

    node: str
    op: str  # e.g. "convolution_backward", "aten.mean.dim"
    rule: str  # a rule of partition.verdict.REGISTRY, or "not_partitioned"
    reason: str


@dataclasses.dataclass
class Report:
    rows: list[ReportRow]  # one per convolution_backward
    # Every op of the program kept on CPU (getitems aside), with its reason.
    on_cpu: list[CpuOp] = dataclasses.field(default_factory=list)
    # Delegated nodes a builder built another way than the options asked (``lower``
    # only: ``decide`` builds nothing).
    fallbacks: list[Fallback] = dataclasses.field(default_factory=list)

    @property
    def delegated(self) -> int:
        return sum(r.delegated for r in self.rows)

    def on_cpu_markdown(self) -> str:
        head = "| node | op | rule | reason |\n|---|---|---|---|"
        lines = [f"| {c.node} | {c.op} | {c.rule} | {c.reason} |" for c in self.on_cpu]
        return "\n".join([head, *lines])

    def fallbacks_markdown(self) -> str:
        head = "| node | op | asked | built | reason |\n|---|---|---|---|---|"
        lines = [
            f"| {f.node} | {f.op} | {f.asked} | {f.built} | {f.reason} |" for f in self.fallbacks
        ]
        return "\n".join([head, *lines])

    def to_markdown(self) -> str:
        head = (
            "| node | grad_output | weight | stride | padding | dilation | groups | mask "
            "| delegated | reason |\n|---|---|---|---|---|---|---|---|---|---|"
        )
        lines = [
            f"| {r.node} | {r.grad_output} | {r.weight} | {r.stride} | {r.padding} | "
            f"{r.dilation} | {r.groups} | {r.output_mask} | {'yes' if r.delegated else 'no'} "
            f"| {r.summary} |"
            for r in self.rows
        ]
        return "\n".join([head, *lines])


@dataclasses.dataclass
class LoweringResult:
    edge: Any  # executorch EdgeProgramManager
    report: Report


def _conv_bwd_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [n for n in graph.nodes if nodes.is_conv_bwd(n)]


def _cpu_refusals(graph: torch.fx.Graph) -> dict[str, str]:
    """Original name -> why executorch's CPU kernel refuses it, for nodes of ``graph``."""
    refusals = {}
    for node in _conv_bwd_nodes(graph):
        try:
            why = cpu_kernel.refusal(geo.parse(node))
        except geo.ConvArgumentError:
            continue
        if why is not None:
            refusals.update(dict.fromkeys(origins(node), why))
    return refusals


def _row(
    name: str,
    conv: geo.ConvBackward,
    delegated: bool,
    skipped: set | None,
    cpu_refusal: str | None = None,
) -> ReportRow:
    verdict = judge.recorded(name)
    if delegated:
        reason = "delegated"
    elif verdict is not None and not verdict.supported:
        reason = verdict.reason
    elif skipped and name in skipped:
        reason = "skipped by skip_node_id_set"
    else:
        reason = "not partitioned (kept on CPU by the partitioner)"
    return ReportRow(
        node=name,
        grad_output=list(conv.grad_output_shape),
        input=list(conv.input_shape),
        weight=list(conv.weight_shape),
        stride=list(conv.stride),
        padding=list(conv.padding),
        dilation=list(conv.dilation),
        groups=conv.groups,
        output_mask=list(conv.output_mask),
        delegated=delegated,
        reason=reason,
        cpu_refusal=None if delegated else cpu_refusal,
    )


def _qualcomm_passes(program, compiler_specs, skip_node_id_set=None, skip_node_op_set=None):
    """executorch's export passes and to_edge transform passes for the specs' backend.

    The export passes rewrite the program they are given in place (a joint
    graph's scalar comparisons became tensor ones), so they run on a copy: the
    caller's program stays as it was, to be lowered again or judged.
    """
    program = pipeline.prepare_aten(copy.deepcopy(program))
    backend = integration.get("flatbuffer_to_option")(
        integration.get("generate_qnn_executorch_option")(compiler_specs)
    ).backend_options.backend_type
    pass_manager = integration.get("get_qnn_pass_manager_cls")(backend)()
    aten_program = pass_manager.transform_for_export_pipeline(program)
    passes = pass_manager.get_to_edge_transform_passes(
        aten_program,
        compiler_specs=compiler_specs,
        skip_node_id_set=skip_node_id_set,
        skip_node_op_set=skip_node_op_set,
    )
    return aten_program, passes


def transformed(
    program: torch.export.ExportedProgram,
    compiler_specs: list,
    skip_node_id_set: set | None = None,
    skip_node_op_set: set | None = None,
) -> torch.export.ExportedProgram:
    """The edge program the partitioner sees: ``lower``'s export and to_edge transform
    passes (the plugin's included), without partitioning or compiling."""
    with enabled():
        aten_program, passes = _qualcomm_passes(
            program, compiler_specs, skip_node_id_set, skip_node_op_set
        )
        edge = integration.get("to_edge_transform_and_lower")(
            aten_program,
            transform_passes=passes,
            compile_config=integration.get("qnn_edge_config")(),
        )
        return edge.exported_program()


def _reported(node: torch.fx.Node) -> bool:
    """An op the report lists when it stays on CPU (getitems follow their producer)."""
    return node.op == "call_function" and not nodes.is_call(node, operator.getitem)


def decide(
    program: torch.export.ExportedProgram,
    compiler_specs: list,
    skip_node_id_set: set | None = None,
    skip_node_op_set: set | None = None,
) -> Report:
    """The verdict on every node, without compiling: one row per convolution_backward,
    and every op kept on CPU with its reason (``Report.on_cpu``).

    Runs the same export and to_edge transform passes as ``lower`` and asks
    ``partition.judge`` (not the QNN backend's op validation, which needs a
    working backend). "delegated" in the rows means "the rules delegate it".
    """
    with enabled(), judge.recording():
        before = {n.name: geo.parse(n) for n in _conv_bwd_nodes(program.graph)}
        edge_program = transformed(program, compiler_specs, skip_node_id_set, skip_node_op_set)
        context = judge.Context(
            Target.from_compile_specs(compiler_specs, edge_program),
            frozenset(skip_node_id_set or ()),
            frozenset(skip_node_op_set or ()),
        )
        supported: set[str] = set()
        on_cpu = []
        for node in edge_program.graph.nodes:
            if node.op != "call_function":
                continue
            verdict = judge.judge(node, context, log=not nodes.is_max_pool_backward(node))
            judge.record(node, verdict)
            if verdict.supported:
                supported.update(origins(node) if nodes.is_conv_bwd(node) else ())
            elif _reported(node):
                on_cpu.append(CpuOp(node.name, verdict.op, verdict.rejection.rule, verdict.reason))
        refusals = _cpu_refusals(edge_program.graph)
        rows = [_row(n, c, n in supported, None, refusals.get(n)) for n, c in before.items()]
        return Report(rows, on_cpu)


@progress.long_call("lowering")
def lower(
    program: torch.export.ExportedProgram,
    compiler_specs: list,
    skip_node_id_set: set | None = None,
    skip_node_op_set: set | None = None,
) -> LoweringResult:
    """Lower an ExportedProgram (e.g. a joint forward-backward graph) with QNN.

    Runs the Qualcomm flow (export passes, to_edge transform passes,
    ``to_edge_transform_and_lower`` with ``QnnPartitioner``) with the plugin
    enabled, and reports one row per convolution_backward node, every op kept on CPU
    and every delegated node built another way than the options asked (``fallbacks``).
    A program lowered before with the same options, compile specs and toolchain comes
    back from the lowering cache (``lowering_cache.py``).
    """
    with enabled(), progress.run():
        seed = {}
        if options.current.dropout_seed is None and dropout.draws(program):
            # Drawn here as the dropout pass would draw it, so that the cache's key holds it.
            seed["dropout_seed"] = dropout.fresh_seed()
        with enabled(**seed):
            edge, report = lowering_cache.through(
                program,
                compiler_specs,
                (skip_node_id_set, skip_node_op_set),
                lambda: _lower(program, compiler_specs, skip_node_id_set, skip_node_op_set),
                _report_to,
                _report_from,
            )
        return LoweringResult(edge, report)


def _report_to(report: Report) -> dict:
    record = dataclasses.asdict(report)
    json.dumps(record)  # raises for what JSON cannot hold (symbolic sizes)
    return record


def _report_from(record: dict) -> Report:
    return Report(
        [ReportRow(**row) for row in record["rows"]],
        [CpuOp(**op) for op in record["on_cpu"]],
        [Fallback(**fallback) for fallback in record["fallbacks"]],
    )


def _lower(
    program: torch.export.ExportedProgram,
    compiler_specs: list,
    skip_node_id_set: set | None,
    skip_node_op_set: set | None,
) -> tuple[Any, Report]:
    """``lower()`` without its cache: the edge program manager and the report."""
    with judge.recording():
        progress.phase(progress.EXPORT)
        target = Target.from_compile_specs(compiler_specs)
        before = {n.name: geo.parse(n) for n in _conv_bwd_nodes(program.graph)}

        aten_program, passes = _qualcomm_passes(
            program, compiler_specs, skip_node_id_set, skip_node_op_set
        )
        partitioner = integration.get("QnnPartitioner")(
            compiler_specs,
            skip_node_id_set=skip_node_id_set,
            skip_node_op_set=skip_node_op_set,
        )
        with integration.get("QnnManagerContext")({"forward": compiler_specs}):
            edge = integration.get("to_edge_transform_and_lower")(
                aten_program,
                transform_passes=passes,
                partitioner=[partitioner],
                compile_config=integration.get("qnn_edge_config")(),
            )

        graph = edge.exported_program().graph
        remaining = {name for n in _conv_bwd_nodes(graph) for name in origins(n)}
        refusals = _cpu_refusals(graph)
        rows = [
            _row(name, conv, name not in remaining, skip_node_id_set, refusals.get(name))
            for name, conv in before.items()
        ]
        on_cpu = [_cpu_op(node) for node in graph.nodes if _reported(node)]
        on_cpu = [op for op in on_cpu if op is not None]
        fallbacks = judge.recorded_fallbacks(before)
        logger.info(
            "convolution_backward on %s: %d of %d delegated",
            target.soc,
            sum(r.delegated for r in rows),
            len(rows),
        )
        return edge, Report(rows, on_cpu, fallbacks)


def _cpu_op(node: torch.fx.Node) -> CpuOp | None:
    """The top-level node of a lowered program as an op kept on CPU (None: a delegate call)."""
    if getattr(node.target, "__name__", "") == "executorch_call_delegate":
        return None
    for name in origins(node) if nodes.is_conv_bwd(node) else [node.name]:
        verdict = judge.recorded(name)
        if verdict is not None and not verdict.supported:
            return CpuOp(node.name, verdict.op, verdict.rejection.rule, verdict.reason)
    return CpuOp(
        node.name,
        judge.op_name(node),
        "not_partitioned",
        "not partitioned (kept on CPU by the partitioner)",
    )
