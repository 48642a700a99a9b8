"""QNN lowering of ``aten.convolution_backward``: grad_input, grad_weight, grad_bias.

grad_input of a convolution is the transposed convolution of grad_output with
the same weight, stride, padding and groups; the output padding restores the
elements the forward convolution's floor division dropped. How it is built is
chosen by ``Options.input_gradient`` (see ``input_gradient.py``); the default::

    weight (static, HWIO, shared with the forward Conv2d)
      -> Transpose perm (0, 1, 3, 2) -> HWOI
    grad_output (NHWC) --TransposeConv2d(HWOI)--> grad_input (NHWC) [-> Pad]

3-D convolutions use Conv3d / TransposeConv3d on NDHWC activations in the same way.

grad_weight and grad_bias: see ``weight_gradient.py``. The visitor does not
decide support (``partition.support.decide`` does); it raises on a node it
cannot build, which the rules keep from it.
"""

from __future__ import annotations

import torch

from .. import integration, options
from ..geometry import conv as geo
from . import weight_gradient, weight_views
from .input_gradient import FORMULATIONS, GradInputRequest

NodeVisitor = integration.get("NodeVisitor")

TARGET = "aten.convolution_backward.default"


class ConvolutionBackwardVisitor(NodeVisitor):
    target = [TARGET]

    def define_node(self, node: torch.fx.Node, nodes_to_wrappers):
        conv = geo.parse(node)
        if conv.spatial_dims not in (2, 3):  # 1-D nodes are lifted to 2-D by the transform pass
            raise geo.ConvArgumentError(
                f"{node.name}: only 2-D and 3-D convolutions are built here"
            )
        native = integration.get("Qnn_TensorType_t").QNN_TENSOR_TYPE_NATIVE
        grad_output_node = self.get_node(node.args[geo.GRAD_OUTPUT])
        grad_output_value = self.get_tensor(grad_output_node, node)  # NHWC
        grad_output = self.define_tensor(
            grad_output_node, node, grad_output_value, native, nodes_to_wrappers
        )

        def output(index: int, value: torch.Tensor):
            return self.define_tensor(
                node, node, value, native, nodes_to_wrappers, wrapper_idx=index
            )

        want_input, want_weight, want_bias = conv.output_mask
        ops: list = []
        if want_input:
            grad_input_value = self.get_tensor(node, node, 0)  # NHWC after layout transform
            request = GradInputRequest(
                visitor=self,
                node=node,
                conv=conv,
                grad_output=grad_output,
                grad_input=output(0, grad_input_value),
                grad_input_value=grad_input_value,
                nodes_to_wrappers=nodes_to_wrappers,
                output_padding=options.current.output_padding,
                stride=options.current.stride,
            )
            ops += FORMULATIONS[options.current.input_gradient](request)
        if want_weight:
            view = weight_views.grad_view(node)
            if view is None:
                # torch's OIHW: the layout pass leaves weight-side outputs untransformed.
                grad_weight = output(1, node.meta["val"][1])
                order = tuple(range(conv.rank))
            else:  # computed straight into the permute to the delegate's layout
                grad_weight = self.define_tensor(
                    view, node, view.meta["val"], native, nodes_to_wrappers
                )
                # executorch's getitem visitor maps the getitem to output 1
                nodes_to_wrappers.setdefault(node.name, {})[1] = grad_weight
                order = tuple(view.args[1])
            ops += weight_gradient.weight_gradient(
                self,
                node,
                conv,
                grad_output,
                list(grad_output_value.shape),
                grad_weight,
                nodes_to_wrappers,
                result_order=order,
            )
        if want_bias:
            grad_bias = output(2, node.meta["val"][2])
            ops += weight_gradient.bias_gradient(node, grad_output, conv.rank, grad_bias)
        return ops
