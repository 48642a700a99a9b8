"""Public entry points: enable / disable / enabled, and lower() with its report."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import operator
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch

from . import context_cache, delegate_io, integration, logs, nodes, options, progress, signature
from .geometry import conv as geo
from .meta import INDICES_ON_HTP
from .nodes import origins
from .partition import cpu_kernel, judge, max_pool, split
from .partition.target import Target
from .passes import (
    int64_constants,
    layout,
    preserve_output_dtypes,
    record_output_dtypes,
    train_mode,
)
from .passes.batch_norm import StableBatchNorm
from .passes.canonicalize import CanonicalizeConvolutionBackward
from .passes.conv_batch_norm import FoldConvolutionBatchNorm
from .passes.distribute_mul import DistributeMul
from .passes.hardswish import CentredHardActivations
from .passes.loss_scale import ScaleLoss
from .passes.scalar_constants import PairedScalars
from .passes.shared_constants import MergeConstantReads
from .passes.sigmoid import StableSigmoid
from .passes.weight_layout import MoveWeightLayouts

logger = logging.getLogger(__name__)

_state_lock = threading.Lock()
_CONTEXT_ATTR = "_qnn_convbwd_context"


# --- hooks called from the patched executorch code ----------------------------
# Wiring only: every verdict is partition.judge's.


def _on_support_init(checker, edge_program, compiler_specs, skip_ids, skip_ops) -> None:
    context = judge.Context(
        Target.from_compile_specs(compiler_specs, edge_program),
        frozenset(skip_ids or ()),
        frozenset(skip_ops or ()),
    )
    setattr(checker, _CONTEXT_ATTR, context)


def _is_node_supported(original, checker, node: torch.fx.Node) -> bool:
    context: judge.Context | None = getattr(checker, _CONTEXT_ATTR, None)
    if context is None or node.op != "call_function":
        return original()
    return judge.in_partitioner(
        node, context, original, lambda other: checker.is_node_supported(None, other)
    )


def _after_partition(edge_program, partition_tags: dict) -> None:
    """After partitioning: delegates larger than ``max_delegate_ops`` are split
    (``partition.split``), trainable parameters stay top-level tensors, and int64
    constants kept on CPU keep their stored dtype (``passes.int64_constants``); the
    HTP shim is told the ``htp_optimization`` level before executorch's preprocess
    creates the QNN graphs.

    executorch tags a parameter whose users are all delegated into the delegate,
    which then bakes its values into the QNN context. A parameter the joint graph
    returns a gradient for must instead stay a program input that the delegate
    reads at run time: ExecuTorch's training runtime updates it in place.
    """
    from .toolchain.sdk import request_htp_optimization

    request_htp_optimization(options.current.htp_optimization)
    if options.current.max_delegate_ops is not None:
        split.split(edge_program, partition_tags, options.current.max_delegate_ops)
    progress.partitioned(len(partition_tags))
    quant_key = integration.get("QCOM_QUANT_ATTRS")
    for node in signature.trainable_placeholders(edge_program):
        if "delegation_tag" not in node.meta:
            continue
        if any(n.meta.get(quant_key) for n in (node, *node.users)):
            # Quantized (by its metadata): the delegate takes it only as an encoded
            # constant, so it stays baked and will not see optimizer updates.
            logger.warning(
                "%s: trainable but quantized: baked into the delegate as a constant "
                "(training a quantized program does not update it)",
                node.name,
            )
            continue
        del node.meta["delegation_tag"]
        logger.debug("%s: trainable, kept as a delegate input", node.name)
    int64_constants.restore_cpu_constant_dtypes(edge_program)
    _keep_buffer_values(edge_program)
    _check_pool_indices_stay_inside(edge_program)


def _keep_buffer_values(edge_program) -> None:
    """Mutated buffers (running statistics, counters) keep their values in the program.

    executorch serialises only the shape and dtype of a buffer the program mutates,
    unless its placeholder is marked ``et_init_buffer``: a running variance would
    start at zero instead of one. The partition rules keep a mutated buffer's reads
    and writes on CPU (``program_state_on_cpu``); one tagged into a delegate anyway
    would stop being a buffer of the program, so that is an error here rather than a
    program that silently stops updating it.
    """
    signature = edge_program.graph_signature
    mutated = set(signature.buffers_to_mutate.values())
    for node in edge_program.graph.nodes:
        if node.op != "placeholder" or signature.inputs_to_buffers.get(node.name) not in mutated:
            continue
        node.meta["et_init_buffer"] = True
        if "delegation_tag" in node.meta:
            raise RuntimeError(
                f"{node.name}: the mutated buffer {signature.inputs_to_buffers[node.name]} was "
                f"tagged into {node.meta['delegation_tag']}: its updates would be lost "
                "(report this graph)"
            )


def _check_pool_indices_stay_inside(edge_program) -> None:
    """A forward pool delegated with its indices must share its delegate with every
    reader of them: they are int32 in QNN but int64 in the program, so crossing
    between delegates would hand one delegate's int32 bytes to an int64 tensor.
    The partition rule makes this so; this is the check that it did."""
    for node in edge_program.graph.nodes:
        if not node.meta.get(INDICES_ON_HTP) or "delegation_tag" not in node.meta:
            continue
        tag = node.meta["delegation_tag"]
        for user in max_pool.indices_users(node):
            if user.meta.get("delegation_tag") != tag:
                raise RuntimeError(
                    f"{max_pool.FORWARD_OP} {node.name}: delegated with its indices in "
                    f"{tag}, but {user.name} reads them in "
                    f"{user.meta.get('delegation_tag', 'the CPU program')}: the int32 "
                    "indices would cross delegates as int64 (report this graph)"
                )


def _prepare(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """The train-mode rewrites of the ATen program, with the current options."""
    return train_mode.prepare(program, dropout_seed=options.current.dropout_seed)


def _pre_decomposition(exported_program):
    """The stock flow's first plugin hook: a lowering starts."""
    progress.begin_implicit()
    return _prepare(exported_program)


def _before_build(edge_program) -> None:
    progress.phase(progress.BUILD, new_delegate=True)


def _compile(original, compile_specs, graph_names, op_wrapper_lists, programs):
    binary = context_cache.compile_through_cache(
        original, compile_specs, graph_names, op_wrapper_lists, programs
    )
    progress.delegate_done()
    return binary


def _hooks() -> integration.Hooks:
    from .builders import op_max_pool_backward, op_max_pool_with_indices, weight_views
    from .builders.op_convolution import define_convolution
    from .builders.op_convolution_backward import TARGET, ConvolutionBackwardVisitor

    hooks = integration.Hooks()
    hooks.visitor_targets = {
        TARGET: ConvolutionBackwardVisitor,
        op_max_pool_backward.TARGET: op_max_pool_backward.MaxPoolBackwardVisitor,
    }
    hooks.layout_sensitive_ops = (
        integration.get("ops").edge.aten.convolution_backward.default,
        integration.get("ops").edge.aten.max_pool2d_with_indices_backward.default,
    )
    hooks.on_support_init = _on_support_init
    hooks.is_node_supported = _is_node_supported
    hooks.transform_pass = CanonicalizeConvolutionBackward
    # CentredHardActivations before DistributeMul: a gate a * (clamp(..) + 1/2) is distributed.
    # FoldConvolutionBatchNorm before StableBatchNorm: the pairs it cannot fold are decomposed.
    # PairedScalars after both: they write x * (1/6) and a * k.
    hooks.extra_transform_passes = (
        FoldConvolutionBatchNorm,
        StableBatchNorm,
        StableSigmoid,
        CentredHardActivations,
        DistributeMul,
        PairedScalars,
        ScaleLoss,
    )
    hooks.late_transform_passes = (MergeConstantReads, MoveWeightLayouts)
    hooks.layout_edge_condition = layout.is_edge_condition
    hooks.layout_mark = layout.mark_as_transformed
    hooks.record_output_dtypes = record_output_dtypes
    hooks.preserve_output_dtypes = preserve_output_dtypes
    hooks.conv_define = define_convolution
    hooks.visitor_wraps = (
        (op_max_pool_with_indices.TARGET, op_max_pool_with_indices.define_max_pool),
        (op_max_pool_with_indices.CAST_TARGET, op_max_pool_with_indices.define_indices_cast),
        (weight_views.TARGET, weight_views.define_permute),
    )
    hooks.pre_decomposition = _pre_decomposition
    hooks.training_metadata = signature.runtime_training_metadata
    hooks.after_partition = _after_partition
    hooks.before_partition = functools.partial(progress.phase, progress.PARTITION)
    hooks.before_build = _before_build
    hooks.compile = _compile
    hooks.after_build = functools.partial(
        delegate_io.bind_outputs_in_order,
        output_names=integration.qnn_output_names,
        tensor_names=integration.qnn_tensor_names,
    )
    return hooks


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
        integration.install(_hooks())
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

    @property
    def delegated(self) -> int:
        return sum(r.delegated for r in self.rows)

    def on_cpu_markdown(self) -> str:
        head = "| node | op | rule | reason |\n|---|---|---|---|"
        lines = [f"| {c.node} | {c.op} | {c.rule} | {c.reason} |" for c in self.on_cpu]
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
    program = _prepare(copy.deepcopy(program))
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


def lower(
    program: torch.export.ExportedProgram,
    compiler_specs: list,
    skip_node_id_set: set | None = None,
    skip_node_op_set: set | None = None,
) -> LoweringResult:
    """Lower an ExportedProgram (e.g. a joint forward-backward graph) with QNN.

    Runs the Qualcomm flow (export passes, to_edge transform passes,
    ``to_edge_transform_and_lower`` with ``QnnPartitioner``) with the plugin
    enabled, and reports one row per convolution_backward node.
    """
    with enabled(), judge.recording(), progress.run():
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
        logger.info(
            "convolution_backward on %s: %d of %d delegated",
            target.soc,
            sum(r.delegated for r in rows),
            len(rows),
        )
        return LoweringResult(edge, Report(rows, on_cpu))


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
