"""Split a delegated convolution_backward that asks for grad_input and more.

executorch binds a delegate's outputs to the QNN graph's outputs by position,
and QNN lists outputs in the order their tensors are created: the order of the
ops that produce them. grad_input leaves the QNN graph through the NHWC->NCHW
permute the layout pass inserts after its getitem, i.e. *after* grad_weight and
grad_bias, which the convolution_backward op itself produces; the partition
lists the getitems in index order. One node asking for both would bind
grad_input's buffer to grad_weight's data (measured: heap corruption).

Splitting it into a grad_input node followed by a grad_weight/grad_bias node
(same operands) makes creation order follow node order again. The two halves
are independent, so the split changes no value.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch

from .. import nodes
from ..geometry import conv as geo


def split_input_gradient(
    graph_module: torch.fx.GraphModule, delegated: Callable[[torch.fx.Node], bool]
) -> int:
    """Rewrite in place; return how many nodes were split."""
    graph = graph_module.graph
    split = 0
    for node in list(graph.nodes):
        if not nodes.is_conv_bwd(node):
            continue
        mask = list(node.args[geo.OUTPUT_MASK])
        if not mask[0] or not any(mask[1:]) or not delegated(node):
            continue
        getitems = {u.args[1]: u for u in node.users if u.target == operator.getitem}
        value = node.meta["val"]
        last = max([node, *getitems.values()], key=lambda n: list(graph.nodes).index(n))

        args = list(node.args)
        args[geo.OUTPUT_MASK] = [False, *mask[1:]]
        with graph.inserting_after(last):
            rest = graph.create_node("call_function", node.target, tuple(args), dict(node.kwargs))
        rest.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        rest.meta["val"] = (None, *value[1:])
        cursor = rest
        for index in (1, 2):
            old = getitems.get(index)
            if old is None:
                continue
            with graph.inserting_after(cursor):
                new = graph.create_node("call_function", operator.getitem, (rest, index))
            new.meta.update(old.meta)
            old.replace_all_uses_with(new)
            graph.erase_node(old)
            cursor = new

        args = list(node.args)
        args[geo.OUTPUT_MASK] = [True, False, False]
        node.args = tuple(args)
        node.meta["val"] = (value[0], None, None)
        split += 1
    if split:
        graph_module.recompile()
    return split
