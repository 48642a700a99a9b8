"""The convolution_backward rules: what about the op keeps it off QNN.

Each rule is a small function ``(node, conv, target) -> Rejection | None``. Rules
run in order; the first rejection is the node's reason. ``decide`` logs it as
exactly one line::

    convolution_backward <node>: not delegated: <reason> (<values>)

and the same text appears in ``qnn_convbwd.lower()``'s report. The node's whole
verdict (skip options, executorch's own check) is ``judge.judge``'s, which runs
these rules first; the visitor and the passes never re-decide support.

Rules about what the builders can lower (which gradients, how many spatial
dims, dilation) read ``CAPABILITIES``, so widening the lowering is one entry
there plus the builder code; the remaining rules state limits of the target,
of the graph, or of TransposeConv that no capability lifts.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch

from .. import integration, signature
from ..geometry import conv as geo
from ..meta import DEQUANTIZING_COPY, PINNED, WEIGHT_TO_DEVICE, WEIGHT_VIEW
from . import target as targets
from .target import FLOAT_DTYPES, Target
from .verdict import Decision, Rejection, rules, settle
from .verdict import decide as run_rules

logger = logging.getLogger(__name__)

OP = "convolution_backward"

# What the builders can lower. Widening the lowering (a new gradient, another
# number of spatial dims, dilation) means adding its name here together with the
# builder code that handles it; the rules below read this set when they run.
CAPABILITIES: frozenset[str] = frozenset(
    {"grad_input", "grad_weight", "grad_bias", "conv1d", "conv2d", "conv3d", "dilation"}
)
# Every name a rule understands, including those no builder handles yet.
KNOWN_CAPABILITIES: frozenset[str] = frozenset(
    {"grad_input", "grad_weight", "grad_bias", "conv1d", "conv2d", "conv3d", "dilation"}
)
# output_mask order: https://github.com/pytorch/pytorch/blob/main/aten/src/ATen/native/native_functions.yaml
GRADIENTS = ("grad_input", "grad_weight", "grad_bias")


def spatial_capability(spatial_dims: int) -> str:
    return f"conv{spatial_dims}d"


def _missing(*needs: str) -> list[str]:
    return sorted(n for n in needs if n not in CAPABILITIES)


Rule = Callable[[torch.fx.Node, geo.ConvBackward, Target], Rejection | None]
RULES, rule = rules(OP)


# --- target ----------------------------------------------------------------


@rule
def backend_is_htp(node, conv, target):
    # The partitioner runs these rules again with the real target (target.py's policy).
    return targets.backend_is_htp(target, settled_before_partitioning=False)


@rule
def htp_arch_supported(node, conv, target):
    return targets.htp_arch_supported(target, "the TransposeConv2d lowering")


# --- what is asked of the op -------------------------------------------------


@rule
def requested_gradients(node, conv, target):
    asked = [g for g, m in zip(GRADIENTS, conv.output_mask) if m]
    if not asked:
        return Rejection(
            "output_mask asks for no gradient", f"output_mask={list(conv.output_mask)}"
        )
    missing = _missing(*asked)
    if missing:
        return Rejection(
            f"output_mask asks for {', '.join(missing)}, which is not lowered",
            f"output_mask={list(conv.output_mask)}",
        )
    return None


@rule
def not_transposed(node, conv, target):
    if conv.transposed:
        return Rejection("backward of a transposed convolution", "transposed=True")
    return None


def _lowered_dims() -> str:
    dims = [d for d in range(1, 4) if spatial_capability(d) in CAPABILITIES]
    return ", ".join(f"{d}-D" for d in dims) or "none"


@rule
def spatial_dims(node, conv, target):
    if _missing(spatial_capability(conv.spatial_dims)):
        return Rejection(
            f"{conv.spatial_dims}-D convolutions are not lowered",
            f"rank={conv.rank}, lowered: {_lowered_dims()}",
        )
    return None


@rule
def static_shapes(node, conv, target):
    if not conv.is_static:
        return Rejection("dynamic shapes", f"grad_output={list(conv.grad_output_shape)}")
    return None


@rule
def dilation(node, conv, target):
    if any(d != 1 for d in conv.dilation) and _missing("dilation"):
        return Rejection("dilation > 1 is not lowered", f"dilation={list(conv.dilation)}")
    return None


# --- operands ------------------------------------------------------------------


def _weight_node(node: torch.fx.Node) -> torch.fx.Node:
    return node.args[geo.WEIGHT]


def _weight_source(node: torch.fx.Node) -> torch.fx.Node:
    """``node``'s weight, seen through the permutes ``passes.weight_layout`` puts
    between a trainable parameter and its readers: the parameter itself."""
    weight = _weight_node(node)
    while weight.meta.get(WEIGHT_VIEW) or weight.meta.get(WEIGHT_TO_DEVICE):
        weight = weight.args[0]
    return weight


def _is_dequantize(node: torch.fx.Node) -> bool:
    target = getattr(node, "target", None)
    name = getattr(target, "__name__", "") or str(target)
    return node.op == "call_function" and "dequantize" in name


def describe_quantization(attrs: dict) -> str:
    """``uint8 scale=0.0035 zero_point=0`` (per tensor) or ``int8 per-channel axis=0``."""
    dtype = str(attrs.get("dtype", "?")).replace("torch.", "")
    if "scale" in attrs and not isinstance(attrs["scale"], torch.Tensor):
        return f"{dtype} scale={float(attrs['scale']):.6g} zero_point={attrs.get('zero_point')}"
    return f"{dtype} per-channel axis={attrs.get('axis')}"


def _quantized_weight(node: torch.fx.Node) -> tuple[torch.fx.Node, dict] | None:
    """``(the stored weight, its quantization)`` when ``node``'s weight is the bypassed
    dequantize of a quantized constant (a pt2e-quantized convolution's)."""
    weight = _weight_node(node)
    if not _is_dequantize(weight) or not isinstance(weight.args[0], torch.fx.Node):
        return None
    attrs = weight.args[0].meta.get(integration.get("QCOM_QUANT_ATTRS"))
    return (weight.args[0], attrs) if attrs else None


@rule
def not_quantized(node, conv, target):
    # Before weight_values: a quantized weight reaches the node through a dequantize,
    # which must be reported as quantization, not as a computed weight. A quantized
    # weight serves grad_input dequantized in the graph (builders/weights.py): the
    # operands that stay refused are the activations and the gradients.
    stored = _quantized_weight(node)
    if stored is not None:
        weight, attrs = stored
        quantization = f"weight={weight.name} {describe_quantization(attrs)}"
        if conv.output_mask[1] or conv.output_mask[2]:
            return Rejection(
                "grad_weight / grad_bias of a quantized (frozen) weight are not lowered",
                f"{quantization}, output_mask={list(conv.output_mask)}",
            )
        if not integration.get("is_parameter")(weight, target.edge_program) or (
            signature.is_trainable_parameter(weight, target.edge_program)
        ):
            return Rejection(
                "a quantized weight that is not a frozen constant of the program",
                quantization,
            )
        if conv.groups > 1 and not geo.transpose_conv_applies_groups(conv.spatial_dims):
            return Rejection(
                f"a grouped {conv.spatial_dims}-D grad_input needs a block-diagonal filter, "
                "which is not built from a quantized weight",
                f"{quantization}, groups={conv.groups}",
            )
    found = None
    key = integration.get("QCOM_QUANT_ATTRS")
    for role, operand in (("grad_output", node.args[geo.GRAD_OUTPUT]), ("output", node)):
        behind = operand
        if (_is_dequantize(operand) or operand.meta.get(DEQUANTIZING_COPY)) and isinstance(
            operand.args[0], torch.fx.Node
        ):
            behind = operand.args[0]
        attrs = behind.meta.get(key) or operand.meta.get(key)
        if attrs:
            found = f"{role}={behind.name} has QCOM_QUANT_ATTRS: {describe_quantization(attrs)}"
            break
        if _is_dequantize(operand):
            # A graph that has not been through FoldQDQ still has the dequantizes.
            found = f"{role}={operand.name} is produced by a dequantize"
            break
    if found is None and stored is None and _is_dequantize(_weight_node(node)):
        found = f"weight={_weight_node(node).name} is produced by a dequantize"
    if found is not None:
        return Rejection("quantized operand or output", found)
    return None


@rule
def weight_values(node, conv, target):
    # A weight read at run time (a trainable parameter, a graph input, a computed
    # tensor) serves grad_input through a Transpose, dilated in the graph where it
    # must be; the block-diagonal filter of a grouped 3-D node is built from the
    # weight's values, which needs a constant weight.
    if not conv.output_mask[0] or conv.groups == 1:
        return None
    if geo.transpose_conv_applies_groups(conv.spatial_dims):
        return None
    weight = _weight_source(node)
    if not integration.get("is_parameter")(weight, target.edge_program):
        kind = "a graph input" if weight.op == "placeholder" else f"computed by {weight.op}"
        why = f"weight={weight.name} is {kind}"
    elif signature.is_trainable_parameter(weight, target.edge_program):
        why = f"weight={weight.name} is trainable"
    else:
        return None
    return Rejection(
        f"a grouped {conv.spatial_dims}-D grad_input needs a block-diagonal filter built from "
        "the weight's values, and this weight is read at run time",
        why,
    )


@rule
def float_operands(node, conv, target):
    weight = _weight_node(node).meta["val"]
    if weight.dtype not in FLOAT_DTYPES or conv.dtype not in FLOAT_DTYPES:
        return Rejection(
            "operand dtype is not float32 or float16",
            f"grad_output={conv.dtype}, weight={weight.dtype}",
        )
    return None


@rule
def expressible_output_padding(node, conv, target):
    if not conv.output_mask[0]:
        return None  # only grad_input is a transposed convolution
    op = conv.transposed_output_padding()
    if any(not 0 <= o < s for o, s in zip(op, conv.stride)):
        return Rejection(
            "grad_input shape needs an output_padding outside [0, stride)",
            f"output_padding={list(op)}, stride={list(conv.stride)}",
        )
    return None


@rule
def transpose_conv3d_strides(node, conv, target):
    # The HTP's TransposeConv3d is wrong or fails to compile when its H and W
    # strides differ (measured, see geo.transpose_conv_takes_strides). grad_input
    # then runs with the spatial dims reordered so that two equal strides land on
    # H and W; with three different strides no order does.
    if not conv.output_mask[0] or geo.transpose_conv_spatial_order(conv) is not None:
        return None
    return Rejection(
        "the HTP's TransposeConv3d (grad_input) is wrong or fails to compile when its "
        "H and W strides differ, and no order of the spatial dims makes them equal",
        f"stride={list(conv.stride)}",
    )


def decide(node: torch.fx.Node, target: Target, log: bool = True) -> Decision:
    """Run the rules on one node (or take its ``PINNED`` decision); log the rejection,
    if any, as one line. ``Decision.parsed`` is the node's ``geo.ConvBackward``."""
    pinned: Decision | None = node.meta.get(PINNED)
    if pinned is not None:
        return settle(dataclasses.replace(pinned, node=node.name), logger, log)
    return run_rules(
        node, OP, RULES, target, logger=logger, parse=(geo.parse, geo.ConvArgumentError), log_it=log
    )
