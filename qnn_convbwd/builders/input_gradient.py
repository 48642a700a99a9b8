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


# QNN's transposed convolution for each number of spatial dims (1-D is lifted to 2-D).
_TRANSPOSE_CONV_OPS = {2: "OpTransposeConv2d", 3: "OpTransposeConv3d"}


def transpose_conv(req: GradInputRequest) -> list:
    """Transpose(static HWIO weight) -> HWOI; [zero Pad of grad_output ->] TransposeConv
    [-> StridedSlice of its full extent, the "crop" plan]."""
    visitor, node = req.visitor, req.node
    plan = geo.plan_input_gradient(req.conv, req.output_padding)
    weight = weights.weight_for_input_gradient(
        visitor, visitor.get_node(node.args[geo.WEIGHT]), node, plan, req.nodes_to_wrappers
    )
    ops = [] if weight.transpose is None else [weight.transpose]
    source = req.grad_output
    if any(plan.grad_output_pad_end):
        shape = list(
            req.visitor.get_tensor(visitor.get_node(node.args[geo.GRAD_OUTPUT]), node).shape
        )
        for dim, extra in enumerate(plan.grad_output_pad_end):
            shape[1 + dim] += extra  # NHWC: spatial dims start at 1
        source = qnn_ops.native_tensor(
            visitor,
            f"{node.name}_grad_output_padded",
            shape,
            req.grad_input_value.dtype,
            req.nodes_to_wrappers,
        )
        ops.append(
            qnn_ops.zero_pad_end(
                f"{node.name}_pad", req.grad_output, source, plan.grad_output_pad_end
            )
        )

    result = req.grad_input
    if plan.result_slice:
        n, *_, channels = req.grad_input_value.shape  # NHWC
        result = qnn_ops.native_tensor(
            visitor,
            f"{node.name}_full",
            [n, *plan.full_size, channels],
            req.grad_input_value.dtype,
            req.nodes_to_wrappers,
        )
    names = integration.get(_TRANSPOSE_CONV_OPS[req.conv.spatial_dims])
    tconv = qnn_ops.new_op(node.name, names.op_name, [source, weight.hwoi], [result])
    qnn_ops.uint32_param(tconv, names.param_stride, plan.stride)
    qnn_ops.uint32_param(tconv, names.param_pad_amount, plan.pad_amount)
    qnn_ops.uint32_param(tconv, names.param_output_padding, plan.output_padding)
    qnn_ops.uint32_scalar(tconv, names.param_group, plan.groups)
    ops.append(tconv)
    if plan.result_slice:
        n, *_, channels = req.grad_input_value.shape
        ranges = [[0, n, 1], *([b, e, 1] for b, e in plan.result_slice), [0, channels, 1]]
        ops.append(qnn_ops.strided_slice(f"{node.name}_crop", result, req.grad_input, ranges))
    return ops


FORMULATIONS: dict[str, Callable[[GradInputRequest], list]] = {
    "transpose_conv": transpose_conv,
    # transpose_conv on a runtime weight, stored once (see that module).
    input_gradient_runtime_weight.NAME: input_gradient_runtime_weight.build,
}
