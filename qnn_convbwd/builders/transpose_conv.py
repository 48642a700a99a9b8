"""grad_input as QNN's transposed convolution of grad_output with the weight.

The ``transpose_conv`` formulation (``input_gradient.FORMULATIONS``); the
``runtime_weight`` formulation builds the same ops on a run-time weight. Both
take a ``GradInputRequest``.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from .. import integration
from ..geometry import conv as geo
from ..geometry import phases as phase_geometry
from ..partition import judge
from . import qnn_ops, transpose_conv_phases, weights

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class GradInputRequest:
    """What a formulation gets: the node, its parsed arguments and the I/O wrappers."""

    visitor: object  # the NodeVisitor building this node
    node: torch.fx.Node
    conv: geo.ConvBackward
    grad_output: object  # wrapper, NHWC
    grad_input: object  # wrapper, NHWC
    grad_input_value: torch.Tensor  # NHWC value (shape/dtype of grad_input)
    nodes_to_wrappers: dict
    output_padding: str  # Options.output_padding
    stride: str  # Options.stride


# QNN's transposed convolution for each number of spatial dims (1-D is lifted to 2-D).
_TRANSPOSE_CONV_OPS = {2: "OpTransposeConv2d", 3: "OpTransposeConv3d"}


def _activation_perm(order: tuple[int, ...]) -> tuple[int, ...]:
    """Permutation of an NHWC tensor taking its spatial dims in ``order``."""
    return (0, *(1 + o for o in order), len(order) + 1)


def build(req: GradInputRequest) -> list:
    """Transpose(static HWIO weight) -> HWOI; grad_output [upsampled with zeros, or
    zero-padded at the end ->] TransposeConv [-> upsampled with zeros and cropped,
    or sliced out of its full extent (the "crop" plan)].

    Where the op does not take the strides in their order (3-D, H != W), the
    spatial dims are reordered (``geo.transpose_conv_spatial_order``): a Transpose
    before and after the op, and the filter's kernel dims in the same order.
    """
    visitor, node, n2w = req.visitor, req.node, req.nodes_to_wrappers
    dtype = req.grad_input_value.dtype
    order = geo.transpose_conv_spatial_order(req.conv)
    if order is None:  # partition.support keeps such nodes from the visitor
        raise geo.ConvArgumentError(
            f"{node.name}: TransposeConv takes no order of {req.conv.stride}"
        )
    reordered = order != tuple(sorted(order))
    conv = req.conv.with_spatial_order(order)
    plan = geo.plan_input_gradient(conv, req.output_padding, req.stride)
    weight = weights.weight_for_input_gradient(
        visitor, visitor.get_node(node.args[geo.WEIGHT]), node, plan, order, n2w
    )
    if req.stride == "phases":
        declined = phase_geometry.unsupported_reason(conv)
        if declined is None:
            return transpose_conv_phases.build(req, conv, weight)
        if any(s != 1 for s in conv.stride):  # stride 1: the two build the same op
            judge.record_fallback(node, 'stride="phases"', 'stride="zero_insert"', declined)
    ops = list(weight.ops)

    def permuted(shape) -> list[int]:
        return [int(shape[i]) for i in _activation_perm(order)]

    shape = permuted(visitor.get_tensor(visitor.get_node(node.args[geo.GRAD_OUTPUT]), node).shape)
    grad_input_shape = permuted(req.grad_input_value.shape)
    source = req.grad_output
    if reordered:
        source = qnn_ops.native_tensor(
            visitor, f"{node.name}_grad_output_reordered", shape, dtype, n2w
        )
        ops.append(
            qnn_ops.transpose(
                f"{node.name}_reorder", req.grad_output, source, _activation_perm(order)
            )
        )
    if plan.upsamples and not plan.upsample_output:
        upsample, source, shape = qnn_ops.zero_insert(
            visitor, f"{node.name}_upsampled", source, shape, plan.zero_insert, dtype, n2w
        )
        ops += upsample
    if any(plan.grad_output_pad_end):
        shape = list(shape)
        for dim, extra in enumerate(plan.grad_output_pad_end):
            shape[1 + dim] += extra  # NHWC: spatial dims start at 1
        padded = qnn_ops.native_tensor(
            visitor, f"{node.name}_grad_output_padded", shape, dtype, n2w
        )
        ops.append(
            qnn_ops.zero_pad_end(f"{node.name}_pad", source, padded, plan.grad_output_pad_end)
        )
        source = padded

    # The op's result, then (crop plan) the slice of it or (kernel-1 upsampling) the
    # upsampled and cropped result, then (reordered) grad_input.
    n, *_, channels = grad_input_shape
    stages = [("full", [n, *plan.full_size, channels])] if plan.result_slice else []
    if plan.upsample_output:
        # Before upsampling: grad_output's size where strided (kernel 1), grad_input's elsewhere.
        compact = [
            o if f > 1 else i
            for o, i, f in zip(shape[1:-1], grad_input_shape[1:-1], plan.zero_insert)
        ]
        stages.append(("compact", [n, *compact, channels]))
    stages += [("reordered", grad_input_shape)] if reordered else []
    tensors = [
        qnn_ops.native_tensor(visitor, f"{node.name}_{s}", shape, dtype, n2w) for s, shape in stages
    ]
    tensors.append(req.grad_input)
    result = tensors.pop(0)

    names = integration.get(_TRANSPOSE_CONV_OPS[conv.spatial_dims])
    tconv = qnn_ops.new_op(node.name, names.op_name, [source, weight.hwoi], [result])
    qnn_ops.uint32_param(tconv, names.param_stride, plan.stride)
    qnn_ops.uint32_param(tconv, names.param_pad_amount, plan.pad_amount)
    qnn_ops.uint32_param(tconv, names.param_output_padding, plan.output_padding)
    qnn_ops.uint32_scalar(tconv, names.param_group, plan.groups)
    ops.append(tconv)
    if plan.result_slice:
        ranges = [[0, n, 1], *([b, e, 1] for b, e in plan.result_slice), [0, channels, 1]]
        sliced = tensors.pop(0)
        ops.append(qnn_ops.strided_slice(f"{node.name}_crop", result, sliced, ranges))
        result = sliced
    if plan.upsample_output:
        upsampled_ops, result = _upsample_output(req, plan, result, stages[-1][1], tensors.pop(0))
        ops += upsampled_ops
    if reordered:
        back = _activation_perm(geo.inverse_order(order))
        ops.append(qnn_ops.transpose(f"{node.name}_restore", result, tensors.pop(0), back))
    return ops


def _upsample_output(req: GradInputRequest, plan: geo.TransposedConvPlan, source, shape, target):
    """Zero-insert the TransposeConv's output and crop it into ``target``: (ops, target)."""
    node, dtype = req.node, req.grad_input_value.dtype
    cropped = any(begin or end for begin, end in plan.output_crop)
    ops, upsampled, up_shape = qnn_ops.zero_insert(
        req.visitor,
        f"{node.name}_upsampled",
        source,
        shape,
        plan.zero_insert,
        dtype,
        req.nodes_to_wrappers,
        result=None if cropped else target,
    )
    if cropped:
        ranges = [[0, up_shape[0], 1]]
        for dim, (begin, end) in enumerate(plan.output_crop):
            ranges.append([begin, up_shape[1 + dim] - end, 1])
        ranges.append([0, up_shape[-1], 1])
        ops.append(qnn_ops.strided_slice(f"{node.name}_crop", upsampled, target, ranges))
    return ops, target
