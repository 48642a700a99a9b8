"""One ``get_attr`` node per constant again, after executorch re-traced the graph.

I64toI32 and LayoutTransform are ``ExportPass``es: re-tracing gives every reader of a constant
attribute its own ``get_attr`` node, and executorch's ``lift_constant_tensor_pass``
then lifts each node into its own placeholder. A weight the plugin made (a
convolution weight with its batch norm folded in, ``passes.conv_batch_norm``)
that the forward convolution and grad_input both read would become two
constants of the delegate, each stored in the context binary (measured, SM8650:
a bias-only graph with frozen 64x64x3x3 weights, context 381,184 bytes instead of
246,016; tests/test_conv_batch_norm.py). Merging the nodes of one attribute is
common-subexpression elimination of a read: the values are the same tensor.
"""

from __future__ import annotations

import logging

import torch
from torch.fx.passes.infra.pass_base import PassBase, PassResult

logger = logging.getLogger(__name__)


def merge_constant_reads(graph_module: torch.fx.GraphModule) -> int:
    """Replace repeated ``get_attr`` nodes of one attribute by the first; returns how many."""
    first: dict[str, torch.fx.Node] = {}
    merged = 0
    for node in list(graph_module.graph.nodes):
        if node.op != "get_attr":
            continue
        kept = first.setdefault(node.target, node)
        if kept is node:
            continue
        node.replace_all_uses_with(kept)
        graph_module.graph.erase_node(node)
        merged += 1
    if merged:
        logger.debug("%d repeated constant reads merged", merged)
        graph_module.recompile()
    return merged


class MergeConstantReads(PassBase):
    """to_edge transform pass running ``merge_constant_reads`` (after LayoutTransform)."""

    def __init__(self, edge_program=None) -> None:
        super().__init__()

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        return PassResult(graph_module, merge_constant_reads(graph_module) > 0)
