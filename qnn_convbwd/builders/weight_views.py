"""The permutes ``passes.weight_layout`` puts around a trainable weight, folded away.

Inside a delegate, a trainable weight arrives in the QNN filter layout and a
permute (``meta.WEIGHT_VIEW``) gives the convolutions torch's layout back; their
grad_weight is permuted to the filter layout (``meta.GRAD_VIEW``) on its way
out. Neither permute is built: the convolutions read the arriving tensor
(``runtime_tensors.runtime_tensor`` resolves a folded view to its source), and
the convolution_backward computes grad_weight straight into the view's output
(``grad_view``). A view that is read otherwise in its graph (it left the
delegate, or a reader is not a convolution's weight) is built as executorch
builds any permute.
"""

from __future__ import annotations

import operator

import torch

from .. import integration, nodes, signature
from ..meta import GRAD_VIEW, WEIGHT_VIEW

TARGET = "aten.permute_copy.default"


def _is_view(node: object, key: str) -> bool:
    """The permute itself (a delegate input made from it keeps its metadata)."""
    return nodes.is_call(node, _permute()) and bool(node.meta.get(key))


def _permute():
    return integration.get("ops").edge.aten.permute_copy.default


def folded_weight_view(node: object) -> bool:
    """A ``WEIGHT_VIEW`` of a delegate input, read only as convolution weights (not
    also a delegate output: a reader on CPU needs torch's layout).

    In the top-level program (the partitioner validating ops) its source is the
    CPU permute, not an input: there it is built, as the validation needs an op.
    """
    return (
        _is_view(node, WEIGHT_VIEW)
        and node.args[0].op == "placeholder"
        and all(user.op != "output" for user in node.users)
        and nodes.filter_operand_uses(node)
    )


def grad_view(conv_bwd: torch.fx.Node) -> torch.fx.Node | None:
    """The ``GRAD_VIEW`` permute that is the only reader of ``conv_bwd``'s grad_weight
    and an output of its delegate, if there is one: grad_weight is computed into it."""
    items = [u for u in conv_bwd.users if u.target == operator.getitem and u.args[1] == 1]
    if len(items) != 1 or len(items[0].users) != 1:
        return None
    (view,) = items[0].users
    if not _is_view(view, GRAD_VIEW) or any(user.op != "output" for user in view.users):
        return None  # (in the top-level program the CPU permute reads it)
    return view


def _folded(node: torch.fx.Node) -> bool:
    if _is_view(node, WEIGHT_VIEW):
        return folded_weight_view(node)
    if _is_view(node, GRAD_VIEW):
        item = node.args[0]
        return nodes.is_getitem_of(item, nodes.is_conv_bwd) and grad_view(item.args[0]) is node
    return False


def _top_level(program) -> bool:
    """``program`` is the whole training program (the partitioner validating ops), not a
    delegate's: a trainable parameter is still one of its placeholders. (A weight the
    program stores in the filter layout, ``passes.filter_storage``, has no CPU permute
    in front of its views, so there they look folded and are built for validation.)"""
    return any(
        signature.is_trainable_parameter(n, program)
        for n in program.graph.nodes
        if n.op == "placeholder"
    )


def define_permute(original, visitor, node: torch.fx.Node, nodes_to_wrappers):
    """``integration.Hooks.visitor_wraps`` for executorch's permute visitor."""
    if _folded(node) and not _top_level(visitor.edge_program):
        return None
    return original()
