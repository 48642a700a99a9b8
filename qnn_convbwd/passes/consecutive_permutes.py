"""Consecutive permutes folded before partitioning, where the outer one stands.

A linear layer's weight gradient in a joint graph is
``permute(permute(mm(grad.T, x)))``. executorch's ``FuseConsecutiveTranspose``
(a preprocess pass, after partitioning) replaces the pair by one new permute
inserted right after the *inner* one, so a delegate output moves ahead of the
outputs built between the two. The QNN graph lists its outputs in the order
they are built, the delegate binds them by position, and the gradient then
lands in another output's buffer: measured with a trainable ``nn.Linear``
(weight 10x48 and bias), the 1,920-byte weight gradient was written into the
bias gradient's 40-byte buffer, overwriting the bias itself and then the
heap. Folded here, where the outer permute stands, the partition and the QNN
graph list the outputs in one order.
"""

from __future__ import annotations

import torch

from .. import integration


def fold_consecutive_permutes(graph_module: torch.fx.GraphModule) -> int:
    """Rewrite in place; return how many pairs were folded."""
    permute = integration.get("ops").edge.aten.permute_copy.default
    folded = 0
    for outer in list(graph_module.graph.nodes):
        if outer.op != "call_function" or outer.target != permute:
            continue
        inner = outer.args[0]
        if not (isinstance(inner, torch.fx.Node) and inner.target == permute):
            continue
        if len(inner.users) != 1:
            continue
        first, second = list(inner.args[1]), list(outer.args[1])
        dims = len(first)
        first = [d % dims for d in first]
        composed = [first[d % dims] for d in second]
        source = inner.args[0]
        if composed == list(range(dims)):
            outer.replace_all_uses_with(source)
        else:
            outer.args = (source, composed)
        folded += 1
    if folded:
        graph_module.graph.eliminate_dead_code()
        graph_module.recompile()
    return folded
