"""QNN lowering of ``aten.convolution_backward`` (input gradient).

grad_input of a convolution is the transposed convolution of grad_output with
the same weight, stride, padding and groups; the output padding restores the
elements the forward convolution's floor division dropped. The graph built is::

    weight (static, HWIO, shared with the forward Conv2d)
      -> Transpose perm (0, 1, 3, 2) -> HWOI
    grad_output (NHWC) --TransposeConv2d(HWOI)--> grad_input (NHWC) [-> Pad]

The visitor does not decide support; ``partition.support.decide`` does, before
partitioning. It raises on a node it cannot build, which the rules keep from it.
"""

from __future__ import annotations

import torch

from .. import integration, options
from . import conv_geometry as geo
from . import qnn_ops, weights

NodeVisitor = integration.get("NodeVisitor")

TARGET = "aten.convolution_backward.default"


class ConvolutionBackwardVisitor(NodeVisitor):
    target = [TARGET]

    def define_node(self, node: torch.fx.Node, nodes_to_wrappers):
        conv = geo.parse(node)
        if conv.output_mask != (True, False, False) or conv.spatial_dims != 2:
            raise geo.ConvArgumentError(
                f"{node.name}: this visitor builds grad_input of 2-D convolutions only"
            )
        native = integration.get("Qnn_TensorType_t").QNN_TENSOR_TYPE_NATIVE

        grad_output_node = self.get_node(node.args[geo.GRAD_OUTPUT])
        grad_output = self.define_tensor(
            grad_output_node,
            node,
            self.get_tensor(grad_output_node, node),
            native,
            nodes_to_wrappers,
        )
        weight = weights.weight_for_input_gradient(
            self, self.get_node(node.args[geo.WEIGHT]), node, nodes_to_wrappers
        )
        grad_input_value = self.get_tensor(node, node, 0)  # NHWC after layout transform
        grad_input = self.define_tensor(
            node, node, grad_input_value, native, nodes_to_wrappers, wrapper_idx=0
        )

        plan = geo.plan_input_gradient(
            conv,
            fold_output_padding=conv.is_depthwise and options.current.fold_depthwise_output_padding,
        )
        ops = [] if weight.transpose is None else [weight.transpose]
        tconv_out = grad_input
        if any(plan.trailing_pad):
            shape = list(grad_input_value.shape)
            for dim, extra in enumerate(plan.trailing_pad):
                shape[1 + dim] -= extra  # NHWC: spatial dims start at 1
            tconv_out = qnn_ops.native_tensor(
                self, f"{node.name}_tconv", shape, grad_input_value.dtype, nodes_to_wrappers
            )

        names = integration.get("OpTransposeConv2d")
        tconv = qnn_ops.new_op(node.name, names.op_name, [grad_output, weight.hwoi], [tconv_out])
        qnn_ops.uint32_param(tconv, names.param_stride, plan.stride)
        qnn_ops.uint32_param(tconv, names.param_pad_amount, plan.pad_amount)
        qnn_ops.uint32_param(tconv, names.param_output_padding, plan.output_padding)
        qnn_ops.uint32_scalar(tconv, names.param_group, plan.groups)
        ops.append(tconv)

        if tconv_out is not grad_input:
            pad_names = integration.get("OpPad")
            pad = qnn_ops.new_op(f"{node.name}_pad", pad_names.op_name, [tconv_out], [grad_input])
            qnn_ops.uint32_scalar(pad, pad_names.param_scheme, pad_names.Scheme.CONSTANT)
            qnn_ops.float_scalar(pad, pad_names.param_pad_constant_value, 0.0)
            amounts = [[0, 0], *([0, extra] for extra in plan.trailing_pad), [0, 0]]
            qnn_ops.uint32_param(pad, pad_names.param_pad_amount, amounts)
            ops.append(pad)
        return ops
