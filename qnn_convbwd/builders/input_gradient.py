"""Formulations of grad_input on QNN, selected by ``Options.input_gradient``.

Each formulation builds the ops that turn grad_output into grad_input for one
convolution_backward node and returns them in execution order. They share the
signature of ``transpose_conv`` below; register new ones in FORMULATIONS.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from .. import integration
from . import conv_geometry as geo
from . import input_gradient_runtime_weight, qnn_ops, weights


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


def transpose_conv(req: GradInputRequest) -> list:
    """Transpose(static HWIO weight) -> HWOI; grad_output [upsampled with zeros or
    zero-padded at the end ->] TransposeConv2d [-> upsampled with zeros -> cropped]
    (see ``geo.plan_input_gradient``)."""
    visitor, node = req.visitor, req.node
    weight = weights.weight_for_input_gradient(
        visitor, visitor.get_node(node.args[geo.WEIGHT]), node, req.nodes_to_wrappers
    )
    plan = geo.plan_input_gradient(req.conv, req.output_padding, req.stride)
    ops = [] if weight.transpose is None else [weight.transpose]
    source = req.grad_output
    dtype = req.grad_input_value.dtype
    shape = list(req.visitor.get_tensor(visitor.get_node(node.args[geo.GRAD_OUTPUT]), node).shape)
    if plan.upsamples and not plan.upsample_output:
        upsample, source, shape = qnn_ops.zero_insert(
            visitor,
            f"{node.name}_upsampled",
            source,
            shape,
            plan.zero_insert,
            dtype,
            req.nodes_to_wrappers,
        )
        ops += upsample
    if any(plan.grad_output_pad_end):
        for dim, extra in enumerate(plan.grad_output_pad_end):
            shape[1 + dim] += extra  # NHWC: spatial dims start at 1
        padded = qnn_ops.native_tensor(
            visitor, f"{node.name}_grad_output_padded", shape, dtype, req.nodes_to_wrappers
        )
        ops.append(
            qnn_ops.zero_pad_end(f"{node.name}_pad", source, padded, plan.grad_output_pad_end)
        )
        source = padded

    result = req.grad_input
    if plan.upsample_output:
        # The convolution's output: grad_output's spatial size (kernel 1 where strided).
        conv_shape = list(req.grad_input_value.shape)
        for dim, (begin, end) in enumerate(plan.pad_amount):
            conv_shape[1 + dim] = shape[1 + dim] - 1 + _kernel_extent(req.conv, dim) - begin - end
        result = qnn_ops.native_tensor(
            visitor, f"{node.name}_compact", conv_shape, dtype, req.nodes_to_wrappers
        )
    names = integration.get("OpTransposeConv2d")
    tconv = qnn_ops.new_op(node.name, names.op_name, [source, weight.hwoi], [result])
    qnn_ops.uint32_param(tconv, names.param_stride, plan.stride)
    qnn_ops.uint32_param(tconv, names.param_pad_amount, plan.pad_amount)
    qnn_ops.uint32_param(tconv, names.param_output_padding, plan.output_padding)
    qnn_ops.uint32_scalar(tconv, names.param_group, plan.groups)
    ops.append(tconv)
    if plan.upsample_output:
        ops += _upsample_output(req, plan, result, conv_shape)
    return ops


def _kernel_extent(conv: geo.ConvBackward, dim: int) -> int:
    return conv.dilation[dim] * (conv.kernel[dim] - 1) + 1


def _upsample_output(req: GradInputRequest, plan: geo.TransposedConvPlan, source, shape) -> list:
    """Zero-insert the TransposeConv2d's output and crop it to grad_input."""
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
        result=None if cropped else req.grad_input,
    )
    if cropped:
        ranges = [[0, up_shape[0], 1]]
        for dim, (begin, end) in enumerate(plan.output_crop):
            ranges.append([begin, up_shape[1 + dim] - end, 1])
        ranges.append([0, up_shape[-1], 1])
        ops.append(qnn_ops.strided_slice(f"{node.name}_crop", upsampled, req.grad_input, ranges))
    return ops


FORMULATIONS: dict[str, Callable[[GradInputRequest], list]] = {
    "transpose_conv": transpose_conv,
    # transpose_conv on a runtime weight, stored once (see that module).
    input_gradient_runtime_weight.NAME: input_gradient_runtime_weight.build,
}
