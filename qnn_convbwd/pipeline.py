"""The plugin's pipeline: every stage it adds to executorch's Qualcomm flow, in order.

A lowering (``qnn_convbwd.lower``, or ``to_edge_transform_and_lower`` with
``QnnPartitioner`` after ``enable()``) passes through executorch's flow; the plugin
adds its stages at these points, in this order:

==================  ==========================================================
``aten``            the ATen program, before executorch decomposes it
                    (``QnnPartitioner.transform_for_pre_decomposition``)
``quantization``    to_edge transform passes after executorch's
                    ``RemoveRedundancy``, before its ``AnnotateQuantAttrs``
                    (quantize / dequantize nodes still in the graph)
``edge``            to_edge transform passes: after executorch's clean-up
                    (``RemoveRedundancy``, ``CanonicalizeConv``,
                    ``RecomposePadMaxPool2d``), before ``LayoutTransform`` and
                    ``I64toI32``
``canonicalize``    the rewrites of ``CanonicalizeConvolutionBackward``, the last
                    ``edge`` pass
``late``            to_edge transform passes after ``I64toI32`` and
                    ``LayoutTransform`` (both re-trace the graph), before
                    ``AnnotateGetAttr``
``partition``       executorch's ``QnnOperatorSupport`` asks the partition rules
                    (``partition.verdict.REGISTRY``, run by ``partition.judge``)
``after_partition`` on the tagged program, before executorch's preprocess
``build``           ``QnnBackend.preprocess``: the delegates spread over forked
                    processes, node visitors, the layout pass's view of the
                    plugin's ops, each delegate's QNN ops
``compile``         the QNN manager's ``Compile`` of a context binary
``emit``            ``to_executorch``: the training metadata of a joint program
==================  ==========================================================

``STAGES`` (built by ``stages()``) lists every stage once, with the option that
switches it, if any, and why it sits where it does. ``hooks()`` turns the list
into the ``integration.Hooks`` that ``integration.install`` patches into
executorch; ``api`` only calls ``hooks()`` and ``prepare_aten``. To add a stage,
add a ``Stage`` here at the place it must run (docs/contributing.md).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from . import after_partition as after
from . import context_cache, delegate_io, integration, parallel_finalize, progress, signature
from .partition import judge
from .partition.target import Target
from .passes import (
    canonicalize,
    filter_storage,
    layout,
    preserve_output_dtypes,
    record_output_dtypes,
    straight_through,
)
from .passes import optimizer as optimizer_pass
from .passes import train_mode as train_mode_pass
from .passes.adaptive_pool import AdaptivePoolsAsProducts
from .passes.batch_norm import StableBatchNorm
from .passes.conv_batch_norm import FoldConvolutionBatchNorm
from .passes.distribute_mul import DistributeMul
from .passes.erf import ErfAsPolynomials
from .passes.hardswish import CentredHardActivations
from .passes.layer_norm import TrainableLayerNorms
from .passes.loss_scale import ScaleLoss
from .passes.quant_boundary import DequantizeFloatReaders, QuantizeFloatProducers
from .passes.scalar_constants import PairedScalars
from .passes.shared_constants import MergeConstantReads
from .passes.sigmoid import StableSigmoid
from .passes.strided_scatter import BlockScatters
from .passes.weight_layout import MoveWeightLayouts

POINTS = (
    "aten",
    "quantization",
    "edge",
    "canonicalize",
    "late",
    "partition",
    "after_partition",
    "build",
    "compile",
    "emit",
)


@dataclasses.dataclass(frozen=True)
class Stage:
    point: str  # one of POINTS
    name: str
    run: Any  # a function, a pass class or a visitor class
    why: str  # what it does, and why it runs here
    gate: str = ""  # the option(s) that switch it ("": it always runs)
    # The ``integration.Hooks`` field it fills; "" for ``canonicalize`` steps, which
    # ``CanonicalizeConvolutionBackward`` runs itself.
    hook: str = ""


_CONTEXT_ATTR = "_qnn_convbwd_context"


# --- the wiring the stages need ----------------------------------------------------------
# Wiring only: every verdict is partition.judge's.


def prepare_aten(program: Any) -> Any:
    """The ``aten`` stages on an ATen program, with the current options."""
    from . import options

    program = straight_through.lower_fake_quantizes(program)
    return train_mode_pass.prepare(program, dropout_seed=options.current.dropout_seed)


def _pre_decomposition(exported_program: Any) -> Any:
    """The stock flow's first plugin hook: a lowering starts."""
    progress.begin_implicit()
    return prepare_aten(exported_program)


def _on_support_init(checker, edge_program, compiler_specs, skip_ids, skip_ops) -> None:
    context = judge.Context(
        Target.from_compile_specs(compiler_specs, edge_program),
        frozenset(skip_ids or ()),
        frozenset(skip_ops or ()),
    )
    setattr(checker, _CONTEXT_ATTR, context)


def _is_node_supported(original, checker, node) -> bool:
    context: judge.Context | None = getattr(checker, _CONTEXT_ATTR, None)
    if context is None or node.op != "call_function":
        return original()
    return judge.in_partitioner(
        node, context, original, lambda other: checker.is_node_supported(None, other)
    )


def _request_htp_optimization(edge_program: Any, partition_tags: dict) -> None:
    from . import options
    from .toolchain.sdk import request_htp_optimization

    request_htp_optimization(options.current.htp_optimization)


def _preprocess(original, edge_programs, compile_specs, build_observed: bool):
    return parallel_finalize.preprocess(
        original, edge_programs, compile_specs, build_observed=build_observed
    )


def _before_build(edge_program: Any) -> None:
    progress.phase(progress.BUILD, new_delegate=True)


def _compile(original, compile_specs, graph_names, op_wrapper_lists, programs):
    binary = context_cache.compile_through_cache(
        original, compile_specs, graph_names, op_wrapper_lists, programs
    )
    progress.delegate_done()
    return binary


def _bind_outputs(edge_program: Any, wrappers: list) -> list:
    return delegate_io.bind_outputs_in_order(
        edge_program,
        wrappers,
        output_names=integration.qnn_output_names,
        tensor_names=integration.qnn_tensor_names,
    )


# --- the stages ----------------------------------------------------------------------


@functools.cache
def stages() -> tuple[Stage, ...]:
    """Every stage, in the order it runs (builders are imported on first use)."""
    from .builders import (
        op_avg_pool_backward,
        op_dequantize,
        op_max_pool_backward,
        op_max_pool_with_indices,
        weight_views,
    )
    from .builders.op_convolution import define_convolution
    from .builders.op_convolution_backward import TARGET, ConvolutionBackwardVisitor

    edge_ops = integration.get("ops").edge.aten
    canonicalize_stages = (
        Stage(
            "canonicalize",
            "unbake_conv1d_weights",
            canonicalize.unbake_conv1d_weights,
            "forward 1-D convolutions read their trainable weight, not the frozen copy "
            "executorch's CanonicalizeConv made",
        ),
        Stage(
            "canonicalize",
            "narrow_int64_scalars",
            canonicalize.narrow_int64_scalars,
            "int64 scalar constants of integer tails (cross-entropy targets) become int32",
        ),
        Stage(
            "canonicalize",
            "narrow_int64_comparisons",
            canonicalize.narrow_int64_comparisons,
            "int64 constants compared with integer tensors get an int32 spec",
        ),
        Stage(
            "canonicalize",
            "name_full_reductions",
            canonicalize.name_full_reductions,
            "sums over every dim name their dims (a loss tail QNN takes)",
        ),
        Stage(
            "canonicalize",
            "fold_permute_pairs",
            canonicalize.fold_permute_pairs,
            "permute pairs (a linear layer's weight gradient) folded where the outer one "
            "stands, so QNN lists the delegate's outputs in the order of its signature",
        ),
        Stage(
            "canonicalize",
            "lift_conv1d",
            canonicalize.lift_conv1d_to_2d,
            "1-D convolutions become 2-D ones with a unit height, delegated or not "
            "(executorch's CPU kernel computes 2-D nodes only); before the steps that "
            "read 2-D geometry",
        ),
        Stage(
            "canonicalize",
            "split_grad_input",
            canonicalize.split_grad_input,
            "on delegated nodes: grad_input split from grad_weight / grad_bias",
        ),
        Stage(
            "canonicalize",
            "static_shape_operands",
            canonicalize.static_shape_operands,
            "on delegated nodes: operands read only for their shape (a convolution_backward's, "
            "an avg_pool2d_backward's input) become a static full",
        ),
        Stage(
            "canonicalize",
            "max_pool_backwards",
            canonicalize.max_pool_backwards,
            "delegated max-pool backwards get int32 indices and a shape-only input; those "
            "kept on CPU are made right there (executorch's kernel is wrong)",
        ),
    )
    return (
        Stage(
            "aten",
            "store_filter_layouts",
            filter_storage.store,
            "run by training.lower_for_training on the joint program before the optimizer: "
            "trainable convolution weights are stored in the filter layout the delegate "
            "reads, with permutes the visitors fold, so no permute runs on CPU in a step",
            gate="weight_storage",
        ),
        Stage(
            "aten",
            "in_program_optimizer",
            optimizer_pass.attach,
            "run by training.lower_for_training(optimizer=...) on the joint program before "
            "lower(): trainable parameters, the optimizer's state, the learning rate (and a "
            "dynamic loss scale) become buffers the program updates, the gradients feed the "
            "update, which the rule optimizer_on_cpu keeps on CPU in fp32",
        ),
        Stage(
            "aten",
            "straight_through_estimator",
            straight_through.lower_fake_quantizes,
            "run by prepare_aten before train_mode: the straight-through quantizes "
            "(quantized.straight_through) become quantize / dequantize pairs, which "
            "executorch's AnnotateQuantAttrs and FoldQDQ fold into quantization metadata; "
            "their backward is ATen already",
        ),
        Stage(
            "aten",
            "train_mode",
            _pre_decomposition,
            "dropout draws become a counter-based hash on CPU (passes.dropout), then "
            "train-mode batch norms become batch statistics and running-statistic updates "
            "(passes.train_mode): executorch's decompositions and to_edge reject the "
            "train-mode ops, so they go first (option dropout_seed: the masks' keys)",
            hook="pre_decomposition",
        ),
        Stage(
            "quantization",
            "quantize_float_producers",
            QuantizeFloatProducers,
            "a quantizing copy between a tensor computed in float (a trainable adapter "
            "under a straight-through estimator) and its quantize, which executorch's "
            "AnnotateQuantAttrs would otherwise write on the float op itself; before it",
            hook="quantization_passes",
        ),
        Stage(
            "edge",
            "dequantize_float_readers",
            DequantizeFloatReaders,
            "a dequantizing copy between a quantized tensor and the ops that read it as "
            "float (a float head on a quantized backbone); after executorch's FoldQDQ, "
            "which removed the dequantize",
            hook="transform_passes",
        ),
        Stage(
            "edge",
            "fold_conv_batch_norm",
            FoldConvolutionBatchNorm,
            "eval-mode batch norms after a frozen convolution folded into its weight; "
            "before StableBatchNorm, which decomposes the pairs it cannot fold",
            gate="batch_norm",
            hook="transform_passes",
        ),
        Stage(
            "edge",
            "stable_batch_norm",
            StableBatchNorm,
            "the remaining eval-mode batch norms as (x - mean) * scale + b",
            gate="batch_norm",
            hook="transform_passes",
        ),
        Stage(
            "edge",
            "trainable_layer_norms",
            TrainableLayerNorms,
            "layer norms whose weight or bias trains as mean / rsqrt / products, which read "
            "them at run time (executorch's visitor bakes them); before the partitioner's "
            "rule trainable_parameter_baked sees them",
            hook="transform_passes",
        ),
        Stage(
            "edge",
            "block_scatters",
            BlockScatters,
            "as_strided_scatters whose view is a block of their base (an as_strided's "
            "backward) as a reshape or a pad of the source: executorch's QNN backend has no "
            "visitor for them and executorch 1.5.1's runtime no CPU kernel",
            hook="transform_passes",
        ),
        Stage(
            "edge",
            "adaptive_pools",
            AdaptivePoolsAsProducts,
            "adaptive average pools and their backwards as mm with static averaging "
            "matrices: executorch's QNN backend has no visitor for _adaptive_avg_pool2d or "
            "its backward, and executorch 1.5.1's runtime no CPU kernel for the backward",
            hook="transform_passes",
        ),
        Stage(
            "edge",
            "stable_sigmoid",
            StableSigmoid,
            "sigmoid through tanh, whose fp16 backward keeps its precision",
            gate="sigmoid",
            hook="transform_passes",
        ),
        Stage(
            "edge",
            "centred_hard_activations",
            CentredHardActivations,
            "hardswish / hardsigmoid centred on their kinks; before DistributeMul, so a "
            "gate a * (clamp(..) + 1/2) is distributed",
            gate="hardswish",
            hook="transform_passes",
        ),
        Stage(
            "edge",
            "distribute_mul",
            DistributeMul,
            "a * (b + c) as a*b + a*c where fp16 would cancel",
            gate="mul_over_add",
            hook="transform_passes",
        ),
        Stage(
            "edge",
            "erf_as_polynomials",
            ErfAsPolynomials,
            "erf (GELU's backward) as a series and a rational approximation the HTP runs; "
            "after DistributeMul, which would reorder their Horner steps, and before "
            "PairedScalars, which pairs their constant factors",
            hook="transform_passes",
        ),
        Stage(
            "edge",
            "paired_scalars",
            PairedScalars,
            "scalar constants paired with their tensor operand; after the passes above, "
            "which write x * (1/6) and a * k",
            gate="scalar_constants",
            hook="transform_passes",
        ),
        Stage(
            "edge",
            "scale_loss",
            ScaleLoss,
            "the backward seeded with the static loss scale and the gradients unscaled",
            gate="loss_scale",
            hook="transform_passes",
        ),
        Stage(
            "edge",
            "canonicalize_convolution_backward",
            canonicalize.running(tuple(stage.run for stage in canonicalize_stages)),
            "the canonicalize steps below; last of the plugin's edge passes, so it sees "
            "the graph the partitioner will judge",
            hook="transform_passes",
        ),
        *canonicalize_stages,
        Stage(
            "late",
            "merge_constant_reads",
            MergeConstantReads,
            "one get_attr per constant again after I64toI32 and LayoutTransform re-traced "
            "the graph: each frozen weight stored once",
            hook="late_transform_passes",
        ),
        Stage(
            "late",
            "move_weight_layouts",
            MoveWeightLayouts,
            "trainable convolution weights enter the delegate as HWIO and grad_weight "
            "leaves as HWIO, permuted on CPU (QAIRT finalises run-time OIHW weights "
            "slowly); after canonicalize, whose permute folding would undo the pairs",
            gate="weight_layout",
            hook="late_transform_passes",
        ),
        Stage(
            "partition",
            "rules_per_checker",
            _on_support_init,
            "the target and executorch's skip options, read once per QnnOperatorSupport",
            hook="on_support_init",
        ),
        Stage(
            "partition",
            "rules",
            _is_node_supported,
            "every node judged by the rules of partition.verdict.REGISTRY; the reason of "
            "each op kept on CPU recorded for the report",
            hook="is_node_supported",
        ),
        Stage(
            "partition",
            "progress",
            functools.partial(progress.phase, progress.PARTITION),
            "the progress display enters partitioning",
            hook="before_partition",
        ),
        Stage(
            "after_partition",
            "htp_optimization",
            _request_htp_optimization,
            "the HTP shim told the optimization level before preprocess creates the graphs",
            gate="htp_optimization",
            hook="after_partition",
        ),
        Stage(
            "after_partition",
            "split_large_delegates",
            after.split_large_delegates,
            "delegates larger than the limit split at single float tensors (QAIRT's "
            "finalisation grows faster than linearly with a graph's size)",
            gate="max_delegate_ops",
            hook="after_partition",
        ),
        Stage(
            "after_partition",
            "report_delegates",
            after.report_delegates,
            "the progress display learns the delegate count; after the split",
            hook="after_partition",
        ),
        Stage(
            "after_partition",
            "trainable_parameters_stay_inputs",
            after.keep_trainable_parameters_as_inputs,
            "trainable parameters untagged, so the delegate reads them at run time and "
            "the training runtime's updates reach it",
            hook="after_partition",
        ),
        Stage(
            "after_partition",
            "restore_int64_constants",
            after.restore_int64_constants,
            "int64 constants left on CPU keep their stored dtype; after the tags are final",
            hook="after_partition",
        ),
        Stage(
            "after_partition",
            "keep_buffer_values",
            after.keep_buffer_values,
            "mutated buffers keep their initial values in the program (running variance "
            "starts at one); an error if one was tagged into a delegate",
            hook="after_partition",
        ),
        Stage(
            "after_partition",
            "check_pool_indices",
            after.check_pool_indices_stay_inside,
            "a pool delegated with its indices shares its delegate with their readers",
            hook="after_partition",
        ),
        Stage(
            "build",
            "visitors",
            {
                TARGET: ConvolutionBackwardVisitor,
                op_max_pool_backward.TARGET: op_max_pool_backward.MaxPoolBackwardVisitor,
                op_avg_pool_backward.TARGET: op_avg_pool_backward.AvgPoolBackwardVisitor,
            },
            "node visitors of convolution_backward (grad_input by the formulation the "
            "options pick), max_pool2d_with_indices_backward and avg_pool2d_backward",
            gate="input_gradient, stride, output_padding",
            hook="visitor_targets",
        ),
        Stage(
            "build",
            "layout_sensitive_ops",
            (
                edge_ops.convolution_backward.default,
                edge_ops.max_pool2d_with_indices_backward.default,
                edge_ops.avg_pool2d_backward.default,
            ),
            "LayoutTransform treats the backward ops as NHWC, like their forwards",
            hook="layout_sensitive_ops",
        ),
        Stage(
            "build",
            "layout_edge_condition",
            layout.is_edge_condition,
            "LayoutTransform's boundary test knows the plugin's ops",
            hook="layout_edge_condition",
        ),
        Stage(
            "build",
            "layout_mark",
            layout.mark_as_transformed,
            "LayoutTransform's marking knows the plugin's ops",
            hook="layout_mark",
        ),
        Stage(
            "build",
            "record_output_dtypes",
            record_output_dtypes,
            "I64toI32 records the output dtypes the plugin's int32 rewrites keep",
            hook="record_output_dtypes",
        ),
        Stage(
            "build",
            "preserve_output_dtypes",
            preserve_output_dtypes,
            "I64toI32 restores int64 outputs the program returns",
            hook="preserve_output_dtypes",
        ),
        Stage(
            "build",
            "forward_convolution",
            define_convolution,
            "executorch's forward convolution visitor, wrapped: run-time (trainable) "
            "weights, prepared for the grad_input formulation",
            gate="input_gradient",
            hook="conv_define",
        ),
        Stage(
            "build",
            "forward_max_pool",
            (
                (op_max_pool_with_indices.TARGET, op_max_pool_with_indices.define_max_pool),
                (
                    op_max_pool_with_indices.CAST_TARGET,
                    op_max_pool_with_indices.define_indices_cast,
                ),
            ),
            "executorch's forward max pool and indices cast visitors, wrapped: the "
            "indices computed on the HTP for the backward, and a Maximum chain for "
            "the values of a pool reading a Pad's output",
            hook="visitor_wraps",
        ),
        Stage(
            "build",
            "dequantizing_copy",
            ((op_dequantize.TARGET, op_dequantize.define_dequantizing_copy),),
            "executorch's copy visitor, wrapped: a dequantizing copy is QNN's Dequantize "
            "of the quantized tensor",
            hook="visitor_wraps",
        ),
        Stage(
            "build",
            "weight_views",
            ((weight_views.TARGET, weight_views.define_permute),),
            "executorch's permute visitor, wrapped: the permutes around a trainable "
            "weight in the HWIO layout folded into the convolutions that read it",
            gate="weight_layout",
            hook="visitor_wraps",
        ),
        Stage(
            "build",
            "parallel_finalize",
            _preprocess,
            "a program's delegates built and finalised in forked processes, several at "
            "once, in place of executorch's one-after-another loop",
            gate="finalize_workers",
            hook="preprocess",
        ),
        Stage(
            "build",
            "progress",
            _before_build,
            "the progress display enters a delegate's build",
            hook="before_build",
        ),
        Stage(
            "build",
            "bind_outputs",
            _bind_outputs,
            "a delegate's QNN outputs listed in the order of its signature",
            hook="after_build",
        ),
        Stage(
            "compile",
            "context_cache",
            _compile,
            "a context binary reused when the same graph was compiled before",
            gate="context_cache",
            hook="compile",
        ),
        Stage(
            "emit",
            "training_metadata",
            signature.runtime_training_metadata,
            "a joint program's gradient and parameter indices skip buffer mutations",
            hook="training_metadata",
        ),
        Stage(
            "emit",
            "mutable_buffer_values",
            signature.mutable_initial_value,
            "a buffer the program mutates starts from its own value, also when a constant "
            "holds the same bytes (executorch's emitter would look it up among the "
            "constants and read another buffer's)",
            hook="tensor_spec_value",
        ),
    )


def at(point: str) -> tuple[Stage, ...]:
    """The stages at ``point``, in order."""
    if point not in POINTS:
        raise ValueError(f"unknown pipeline point {point!r}: one of {', '.join(POINTS)}")
    return tuple(stage for stage in stages() if stage.point == point)


# Hooks fields that take every stage naming them, in order.
_LISTS = (
    "quantization_passes",
    "transform_passes",
    "late_transform_passes",
    "after_partition",
)
# Hooks fields that take the entries of every stage naming them, in order.
_CONCATENATED = ("visitor_wraps",)


def _after_partition(steps: tuple) -> Any:
    def run(edge_program: Any, partition_tags: dict) -> None:
        for step in steps:
            step(edge_program, partition_tags)

    return run


def hooks() -> integration.Hooks:
    """The ``integration.Hooks`` the stages fill."""
    filled = integration.Hooks()
    listed: dict[str, list] = {}
    single: set[str] = set()
    for stage in stages():
        if not stage.hook:
            continue
        if stage.hook in _LISTS:
            listed.setdefault(stage.hook, []).append(stage.run)
            continue
        if stage.hook in _CONCATENATED:
            listed.setdefault(stage.hook, []).extend(stage.run)
            continue
        if stage.hook in single:
            raise ValueError(f"pipeline: two stages fill Hooks.{stage.hook}")
        single.add(stage.hook)
        setattr(filled, stage.hook, stage.run)
    filled.quantization_passes = tuple(listed.get("quantization_passes", ()))
    filled.transform_passes = tuple(listed.get("transform_passes", ()))
    filled.late_transform_passes = tuple(listed.get("late_transform_passes", ()))
    filled.visitor_wraps = tuple(listed.get("visitor_wraps", ()))
    filled.after_partition = _after_partition(tuple(listed.get("after_partition", ())))
    return filled


def describe() -> str:
    """The stages as a Markdown table (docs/contributing.md holds its output)."""
    lines = ["| point | stage | option | what and why |", "|---|---|---|---|"]
    for stage in stages():
        lines.append(f"| {stage.point} | {stage.name} | {stage.gate or '-'} | {stage.why} |")
    return "\n".join(lines)
