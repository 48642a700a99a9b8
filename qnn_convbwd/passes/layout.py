"""convolution_backward in executorch's LayoutTransform.

The op is layout sensitive: grad_output, input and grad_input are activations
and travel NHWC inside QNN. Its other outputs are not: grad_weight (OIHW) and
grad_bias ([C]) keep torch's layout, so their getitems are edge conditions the
pass neither marks nor permutes. The node's own axis order is that of its
activations (grad_output's rank); executorch would otherwise take it from
whichever getitem happens to be its first user, a weight-side one included.

The permutes ``passes.weight_layout`` puts between a trainable weight (or its
gradient) and the delegate's filter layout are edge conditions as well: they
move a weight, not an activation.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch

from .. import nodes
from ..geometry import conv as geo
from ..meta import GRAD_VIEW, WEIGHT_VIEW


def is_weight_side_output(node) -> bool:
    """getitem 1 (grad_weight) or 2 (grad_bias) of a convolution_backward."""
    return (
        isinstance(node, torch.fx.Node)
        and node.op == "call_function"
        and node.target == operator.getitem
        and nodes.is_conv_bwd(node.args[0])
        and node.args[1] != 0
    )


def is_filter_input(node) -> bool:
    """A graph input read only as a convolution weight or bias (a trainable parameter
    inside a delegate, or a weight the user feeds): it stays in torch's layout, and
    the visitors permute it into the QNN filter layout themselves."""
    return (
        isinstance(node, torch.fx.Node)
        and node.op == "placeholder"
        and nodes.filter_operand_uses(node)
    )


def is_weight_view(node) -> bool:
    """A permute between a trainable weight (or its gradient) in torch's layout and the
    QNN filter layout it enters (or leaves) the delegate in (``passes.weight_layout``)."""
    return isinstance(node, torch.fx.Node) and bool(
        node.meta.get(WEIGHT_VIEW) or node.meta.get(GRAD_VIEW)
    )


def is_edge_condition(original: Callable, pass_, node) -> bool:
    return (
        is_weight_side_output(node)
        or is_filter_input(node)
        or is_weight_view(node)
        or original(node)
    )


def mark_as_transformed(original: Callable, pass_, node) -> None:
    if not nodes.is_conv_bwd(node):
        original(node)
        return
    grad_output = node.args[geo.GRAD_OUTPUT].meta["val"]
    node.meta[pass_.transformed_tag] = pass_.get_axis_order(list(grad_output.shape))
