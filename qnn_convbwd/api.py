"""Public entry points: enable / disable / enabled, and lower() with its report."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import operator
import threading
from collections.abc import Iterator
from typing import Any

import torch

from . import delegate_io, integration, logs, options, signature
from .builders import conv_geometry as geo
from .partition import cpu_kernel, max_pool, support, trainable
from .partition.target import Target
from .passes import int64_constants, layout, preserve_output_dtypes, record_output_dtypes
from .passes.batch_norm import StableBatchNorm
from .passes.canonicalize import CanonicalizeConvolutionBackward, skip_name
from .passes.conv1d import ON_CPU
from .passes.loss_scale import UNSCALE, ScaleLoss
from .passes.shape_only_operands import SHAPE_OF
from .passes.sigmoid import StableSigmoid

logger = logging.getLogger(__name__)

_state_lock = threading.Lock()
# Latest support decision per node name, written while partitioning.
_decisions: dict[str, support.Decision] = {}
_TARGET_ATTR = "_qnn_convbwd_target"
_SKIP_ATTR = "_qnn_convbwd_skip"
# True while a node's users are checked on its behalf (their rejections are not logged twice).
_nested_check: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "qnn_convbwd_nested_check", default=False
)


def _conv_bwd_edge_op():
    return integration.get("ops").edge.aten.convolution_backward.default


def _is_conv_bwd(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target == _conv_bwd_edge_op()


def origins(node: torch.fx.Node) -> list[str]:
    """The node's name and the names of the nodes it was traced from (``from_node``)."""
    names = [node.name]
    sources = list(node.meta.get("from_node") or [])
    while sources:
        source = sources.pop(0)
        names.append(source.name)
        sources.extend(getattr(source, "from_node", None) or [])
    return names


def _record(node: torch.fx.Node, decision: support.Decision) -> None:
    for name in origins(node):
        _decisions[name] = decision


# --- hooks called from the patched executorch code ----------------------------


def _on_support_init(checker, edge_program, compiler_specs, skip_ids, skip_ops) -> None:
    setattr(checker, _TARGET_ATTR, Target.from_compile_specs(compiler_specs, edge_program))
    setattr(checker, _SKIP_ATTR, (set(skip_ids or ()), set(skip_ops or ())))


def _skipped(checker, node: torch.fx.Node) -> bool:
    """Whether executorch's skip options keep ``node`` on CPU.

    Names are matched as the transform pass saw them (``skip_name``): later
    passes renumber nodes. A node the transform pass lifted for the CPU
    (``ON_CPU``) and whose rules delegate it was kept there by the skip options
    the pass was given.
    """
    skip_ids, skip_ops = getattr(checker, _SKIP_ATTR, (set(), set()))
    return (
        skip_name(node) in skip_ids
        or node.target.__name__ in skip_ops
        or bool(node.meta.get(ON_CPU))
    )


def _warn_if_cpu_cannot_run(node: torch.fx.Node) -> None:
    """One warning for a node that stays on CPU, where executorch's kernel refuses it."""
    try:
        why = cpu_kernel.refusal(geo.parse(node))
    except geo.ConvArgumentError:
        return
    if why is not None:
        logger.warning(cpu_kernel.warning(node.name, why))


def _would_delegate(checker, target: Target, node: torch.fx.Node) -> bool:
    """The partitioner's verdict on ``node``, asked on behalf of another node.

    A convolution_backward is judged by the rules and the skip options without
    building its ops again; any other node by the checker itself, quietly.
    """
    if _is_conv_bwd(node):
        return support.decide(node, target, log=False).supported and not _skipped(checker, node)
    token = _nested_check.set(True)  # the node logs its own verdict when visited
    try:
        return checker.is_node_supported(None, node)
    finally:
        _nested_check.reset(token)


def _judge_conv_bwd(original, checker, target: Target, node: torch.fx.Node) -> bool:
    decision = support.decide(node, target, log=not _nested_check.get())
    if not decision.supported:
        _record(node, decision)
        return False
    if _skipped(checker, node):
        rejection = support.Rejection("skip", "kept on CPU by executorch's skip options", "")
        _record(node, support.Decision(node.name, decision.conv, rejection))
        return False
    # The skip options are applied above, by the name the transform pass saw; executorch
    # matches skip_node_id_set against the current name, which may be another node's.
    if not original(skip_node_id_set=set()):
        rejection = support.Rejection(
            "backend_validation", "rejected by the QNN backend's op validation", target.soc
        )
        if not _nested_check.get():
            logger.warning(rejection.message(node.name))
        _record(node, support.Decision(node.name, decision.conv, rejection))
        return False
    _record(node, decision)
    return True


def _is_node_supported(original, checker, node: torch.fx.Node) -> bool:
    target: Target | None = getattr(checker, _TARGET_ATTR, None)
    if target is not None and _is_conv_bwd(node):
        supported = _judge_conv_bwd(original, checker, target, node)
        if not supported and not _nested_check.get():
            _warn_if_cpu_cannot_run(node)
        return supported
    if target is not None:
        refused = trainable.refusal(node, target.edge_program)
        if refused is not None:
            if not _nested_check.get():
                logger.warning(trainable.message(node, refused))
            return False
    if target is not None and max_pool.is_max_pool_backward(node):
        # The transform pass took the same decision (and logged it) and prepared the node.
        if not max_pool.decide(node, target, log=False).supported or _skipped(checker, node):
            return False
        if original(skip_node_id_set=set()):
            return True
        if not _nested_check.get():
            logger.warning(
                "%s %s: rejected by the QNN backend's op validation on %s after it was "
                "prepared for QNN (int32 indices): executorch's CPU kernel cannot run it",
                max_pool.OP,
                node.name,
                target.soc,
            )
        return False
    if target is not None and node.meta.get(ON_CPU):
        # A reshape the transform pass added around a 1-D node it lifted for
        # executorch's CPU kernel: it runs with that node.
        return False
    if target is not None and node.meta.get(UNSCALE):
        # The 1 / loss_scale of a gradient output: fp32 on CPU, where it is exact.
        return False
    if target is not None and (
        node.meta.get(SHAPE_OF) or node.target in integration.get("constant_operator")
    ):
        # A constant (executorch's constant ops: full, scalar_tensor, arange, and the
        # shape-only stand-ins the plugin inserts) is delegated only together with
        # every consumer: alone it would be a constant delegate output, which QNN does
        # not bind (the runtime then reads past its argument list). The consumers'
        # verdict includes executorch's skip options, which the transform pass cannot see.
        users_delegated = all(_would_delegate(checker, target, user) for user in node.users)
        return users_delegated and original()
    if (
        target is not None
        and node.op == "call_function"
        and node.target == operator.getitem
        and isinstance(node.args[0], torch.fx.Node)
        and _is_conv_bwd(node.args[0])
    ):
        # A getitem is always "supported" upstream; one of a CPU node must stay on CPU
        # (including one executorch's skip options keep there).
        return _would_delegate(checker, target, node.args[0])
    return original()


def _after_partition(edge_program) -> None:
    """After partitioning: trainable parameters stay top-level tensors, and int64
    constants kept on CPU keep their stored dtype (``passes.int64_constants``).

    executorch tags a parameter whose users are all delegated into the delegate,
    which then bakes its values into the QNN context. A parameter the joint graph
    returns a gradient for must instead stay a program input that the delegate
    reads at run time: ExecuTorch's training runtime updates it in place.
    """
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


def _hooks() -> integration.Hooks:
    from .builders import op_max_pool_backward
    from .builders.op_convolution import define_convolution
    from .builders.op_convolution_backward import TARGET, ConvolutionBackwardVisitor

    hooks = integration.Hooks()
    hooks.visitor_targets = {
        TARGET: ConvolutionBackwardVisitor,
        op_max_pool_backward.TARGET: op_max_pool_backward.MaxPoolBackwardVisitor,
    }
    hooks.layout_sensitive_ops = (
        _conv_bwd_edge_op(),
        integration.get("ops").edge.aten.max_pool2d_with_indices_backward.default,
    )
    hooks.on_support_init = _on_support_init
    hooks.is_node_supported = _is_node_supported
    hooks.transform_pass = CanonicalizeConvolutionBackward
    hooks.extra_transform_passes = (StableBatchNorm, StableSigmoid, ScaleLoss)
    hooks.layout_edge_condition = layout.is_edge_condition
    hooks.layout_mark = layout.mark_as_transformed
    hooks.record_output_dtypes = record_output_dtypes
    hooks.preserve_output_dtypes = preserve_output_dtypes
    hooks.conv_define = define_convolution
    hooks.after_partition = _after_partition
    hooks.after_build = delegate_io.check_output_order
    return hooks


# --- public API -------------------------------------------------------------------


def enable(**overrides: Any) -> None:
    """Make executorch's Qualcomm flow lower convolution_backward (idempotent).

    Also makes a QNN SDK usable in this process when one can be found or
    assembled (see ``qnn_convbwd.toolchain``). ``overrides`` set fields of
    ``qnn_convbwd.options.Options``.
    """
    from .toolchain import SdkUnavailable, ensure_sdk

    with _state_lock:
        try:
            ensure_sdk()
        except SdkUnavailable as err:
            logger.warning("no usable QNN SDK (%s); partitioning works, compiling will not", err)
        options.update(**overrides)
        integration.install(_hooks())
        logs.quiet_libraries()  # after install: executorch's modules are imported now


def disable() -> None:
    """Restore executorch exactly as it was before enable()."""
    with _state_lock:
        integration.uninstall()
        options.current = options.Options()


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


@dataclasses.dataclass
class Report:
    rows: list[ReportRow]

    @property
    def delegated(self) -> int:
        return sum(r.delegated for r in self.rows)

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
    aten_op = torch.ops.aten.convolution_backward.default
    return [
        n
        for n in graph.nodes
        if n.op == "call_function" and (n.target == aten_op or _is_conv_bwd(n))
    ]


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
    decision = _decisions.get(name)
    if delegated:
        reason = "delegated"
    elif decision is not None and decision.rejection is not None:
        rejection = decision.rejection
        reason = (
            f"{rejection.reason} ({rejection.values})" if rejection.values else rejection.reason
        )
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
    """executorch's export passes and to_edge transform passes for the specs' backend."""
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
    program: torch.export.ExportedProgram, compiler_specs: list
) -> torch.export.ExportedProgram:
    """The edge program the partitioner sees: ``lower``'s export and to_edge transform
    passes (the plugin's included), without partitioning or compiling."""
    with enabled():
        aten_program, passes = _qualcomm_passes(program, compiler_specs)
        edge = integration.get("to_edge_transform_and_lower")(
            aten_program,
            transform_passes=passes,
            compile_config=integration.get("qnn_edge_config")(),
        )
        return edge.exported_program()


def decide(program: torch.export.ExportedProgram, compiler_specs: list) -> Report:
    """The support decision for every convolution_backward node, without compiling.

    Runs the same export and to_edge transform passes as ``lower`` and asks the
    rules (not the QNN backend's op validation, which needs a working backend).
    "delegated" in the rows means "the rules delegate it".
    """
    with enabled():
        target = Target.from_compile_specs(compiler_specs)
        before = {n.name: geo.parse(n) for n in _conv_bwd_nodes(program.graph)}
        _decisions.clear()
        edge_program = transformed(program, compiler_specs)
        target = target.with_program(edge_program)
        supported: set[str] = set()
        for node in _conv_bwd_nodes(edge_program.graph):
            decision = support.decide(node, target)
            _record(node, decision)
            if decision.supported:
                supported.update(origins(node))
        refusals = _cpu_refusals(edge_program.graph)
        return Report(
            [_row(n, c, n in supported, None, refusals.get(n)) for n, c in before.items()]
        )


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
    with enabled():
        target = Target.from_compile_specs(compiler_specs)
        before = {n.name: geo.parse(n) for n in _conv_bwd_nodes(program.graph)}
        _decisions.clear()

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
        logger.info(
            "convolution_backward on %s: %d of %d delegated",
            target.soc,
            sum(r.delegated for r in rows),
            len(rows),
        )
        return LoweringResult(edge, Report(rows))
