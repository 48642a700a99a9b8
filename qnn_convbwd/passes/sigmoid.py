"""``aten.sigmoid`` as ``0.5 * tanh(0.5 * x) + 0.5`` for the HTP.

QNN's Sigmoid on the HTP (executorch's ``op_sigmoid`` visitor, QAIRT 2.51,
fp16) is 2.4x less accurate than torch's own float16 sigmoid: relative L2
4.1e-4 against 1.7e-4 on ``3 * randn`` inputs (SM8650, docs/numerics.md),
while the HTP's Tanh matches torch float16 (1.6e-4 both). The identity
``sigmoid(x) = 0.5 * tanh(x / 2) + 0.5`` in three QNN ops (ElementWiseMultiply,
Tanh, ElementWiseMultiply + ElementWiseAdd) measures 1.1e-4.

Training graphs are full of sigmoids: SiLU and squeeze-excitation gates in the
forward, and again in their decomposed backward (EfficientNet-B0's joint graph
holds 114), so the per-op error sets the gradients' fidelity.

``StableSigmoid`` (option ``sigmoid="tanh"``, the default) rewrites every
``aten.sigmoid.default`` of the edge program before partitioning; nodes that
end up on CPU compute the same function in fp32.
"""

from __future__ import annotations

import torch

from .. import nodes
from .gated import OptionGatedPass
from .graph_builder import NodeBuilder, rewrite_each


def _rewrite(graph_module: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    (x,) = node.args
    b = NodeBuilder(graph_module, node)
    dtype = x.meta["val"].dtype
    half = b.constant("half", torch.tensor([0.5], dtype=dtype))
    tanh = b.call(b.ops.tanh.default, b.call(b.ops.mul.Tensor, x, half))
    out = b.call(b.ops.add.Tensor, b.call(b.ops.mul.Tensor, tanh, half), half)
    node.replace_all_uses_with(out)
    graph_module.graph.erase_node(node)


def rewrite_sigmoids(graph_module: torch.fx.GraphModule) -> int:
    """Rewrite every floating-point ``aten.sigmoid`` of ``graph_module``; returns how many."""
    return rewrite_each(graph_module, nodes.edge_aten().sigmoid.default, _rewrite)


class StableSigmoid(OptionGatedPass):
    """to_edge transform pass running ``rewrite_sigmoids`` (options.sigmoid)."""

    def enabled(self, options) -> bool:
        return options.sigmoid == "tanh"

    def rewrite(self, graph_module: torch.fx.GraphModule) -> int:
        return rewrite_sigmoids(graph_module)
