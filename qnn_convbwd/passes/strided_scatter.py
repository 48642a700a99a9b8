"""``as_strided_scatter`` into a contiguous block of its base, as a reshape or a pad.

The backward of an ``as_strided`` view is ``as_strided_scatter(full(0), grad, ...)``
(ConvNeXt-Tiny at 32 px: the restride of its pooled 1x1 map); executorch's QNN
backend has no visitor for it and executorch 1.5.1's runtime no kernel. When the
view is a block of the base (``geometry.strided.block``), ``BlockScatters`` writes
the node as::

    covers the base:       view_copy(src, base.shape)
    a block of a full(v):  view_copy(constant_pad_nd(view_copy(src, block.shape),
                                                     block's pads, v), base.shape)

Both are the scatter's values exactly (copies of ``src``'s elements and of ``v``).
Any other scatter stays as it is, and the rule ``strided_scatter_not_a_block`` keeps
it on CPU, naming why.
"""

from __future__ import annotations

import torch

from .. import nodes
from ..geometry import strided
from ..partition.rewrites import (
    BASE,
    SIZE,
    SRC,
    STRIDE,
    full_value,
    scatter_offset,
    scatter_refusal,
)
from .gated import OptionGatedPass
from .graph_builder import NodeBuilder, rewrite_each


def _rewrite(graph_module: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    base, src = node.args[BASE], node.args[SRC]
    found = strided.block(
        base.meta["val"].numel(),
        list(node.args[SIZE]),
        list(node.args[STRIDE]),
        scatter_offset(node),
    )
    b = NodeBuilder(graph_module, node)
    out = src
    if not found.covers:
        padded = b.call(b.ops.view_copy.default, src, list(found.shape))
        # constant_pad_nd lists (before, after) from the last dim to the first.
        pads = [p for pair in reversed(found.pads) for p in pair]
        out = b.call(b.ops.constant_pad_nd.default, padded, pads, full_value(base))
    out = b.call(b.ops.view_copy.default, out, list(base.meta["val"].shape))
    node.replace_all_uses_with(out)
    graph_module.graph.erase_node(node)
    if not base.users and full_value(base) is not None:
        graph_module.graph.erase_node(base)


def rewrite_block_scatters(graph_module: torch.fx.GraphModule) -> int:
    """Rewrite every floating-point ``as_strided_scatter`` of ``graph_module`` into a
    block of its base (``partition.rewrites.scatter_refusal`` None); returns how many."""
    return rewrite_each(
        graph_module,
        nodes.edge_aten().as_strided_scatter.default,
        _rewrite,
        accept=lambda node: scatter_refusal(node) is None,
    )


class BlockScatters(OptionGatedPass):
    """to_edge transform pass running ``rewrite_block_scatters``, always."""

    def enabled(self, options) -> bool:
        return True

    def rewrite(self, graph_module: torch.fx.GraphModule) -> int:
        return rewrite_block_scatters(graph_module)
