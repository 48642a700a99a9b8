"""QNN lowering of ``aten.convolution_backward`` (input gradient).

grad_input of a convolution is the transposed convolution of grad_output with
the same weight, stride, padding and groups; the output padding restores the
elements the forward convolution's floor division dropped. How it is built is
chosen by ``Options.input_gradient`` (see ``input_gradient.py``); the default::

    weight (static, HWIO, shared with the forward Conv2d)
      -> Transpose perm (0, 1, 3, 2) -> HWOI
    grad_output (NHWC) --TransposeConv2d(HWOI)--> grad_input (NHWC) [-> Pad]

The visitor does not decide support (``partition.support.decide`` does); it
raises on a node it cannot build, which the rules keep from it.
"""

from __future__ import annotations

import torch

from .. import integration, options
from . import conv_geometry as geo
from .input_gradient import FORMULATIONS, GradInputRequest

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
        grad_input_value = self.get_tensor(node, node, 0)  # NHWC after layout transform
        grad_input = self.define_tensor(
            node, node, grad_input_value, native, nodes_to_wrappers, wrapper_idx=0
        )
        request = GradInputRequest(
            visitor=self,
            node=node,
            conv=conv,
            grad_output=grad_output,
            grad_input=grad_input,
            grad_input_value=grad_input_value,
            nodes_to_wrappers=nodes_to_wrappers,
            output_padding=options.current.output_padding,
        )
        return FORMULATIONS[options.current.input_gradient](request)
