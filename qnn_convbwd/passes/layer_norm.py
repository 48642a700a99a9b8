"""Layer norms whose weight or bias trains, as ops the HTP runs with run-time parameters.

executorch's ``native_layer_norm`` visitor reads its weight and bias as constants
(``get_parameter``), so a trainable one is kept on CPU by the rule
``trainable_parameter_baked`` (ConvNeXt-Tiny fully trained: 23 of them, each a
delegate boundary). ``TrainableLayerNorms`` writes each such node as the layer
norm's definition over its normalized dims ``D`` (the last ``len(normalized_shape)``)::

    mean = mean(x, D, keepdim)
    xc   = x - mean
    rstd = rsqrt(mean(xc * xc, D, keepdim) + eps)       # two passes: no cancellation
    out  = xc * rstd * weight + bias                    # weight / bias when given

and its three outputs (``out``, ``mean``, ``rstd``, which the decomposed backward
reads) become those nodes. The weight and bias are then ordinary operands, read at
run time like any trainable parameter. Layer norms with frozen affine parameters are
left to executorch's visitor.
"""

from __future__ import annotations

import operator

import torch

from .. import nodes, signature
from .gated import OptionGatedPass
from .graph_builder import NodeBuilder, rewrite_each

# Argument positions of native_layer_norm(input, normalized_shape, weight, bias, eps).
INPUT, SHAPE, WEIGHT, BIAS, EPS = range(5)


def _trains(node: torch.fx.Node, program) -> bool:
    return program is not None and any(
        signature.is_trainable_parameter(node.args[i], program) for i in (WEIGHT, BIAS)
    )


def _rewrite(graph_module: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    x, shape, weight, bias, eps = node.args
    b = NodeBuilder(graph_module, node)
    ops = b.ops
    rank = x.meta["val"].dim()
    dims = list(range(rank - len(shape), rank))
    dtype = x.meta["val"].dtype
    mean = b.call(ops.mean.dim, x, dims, True)
    centred = b.call(ops.sub.Tensor, x, mean)
    variance = b.call(ops.mean.dim, b.call(ops.mul.Tensor, centred, centred), dims, True)
    epsilon = b.constant("eps", torch.tensor([float(eps)], dtype=dtype))
    rstd = b.call(ops.rsqrt.default, b.call(ops.add.Tensor, variance, epsilon))
    out = b.call(ops.mul.Tensor, centred, rstd)
    if weight is not None:
        out = b.call(ops.mul.Tensor, out, weight)
    if bias is not None:
        out = b.call(ops.add.Tensor, out, bias)
    results = (out, mean, rstd)
    for user in list(node.users):
        if user.op != "call_function" or user.target != operator.getitem:
            raise ValueError(f"{node.name}: read by {user.name} other than through a getitem")
        user.replace_all_uses_with(results[user.args[1]])
        graph_module.graph.erase_node(user)
    graph_module.graph.erase_node(node)


def rewrite_trainable_layer_norms(graph_module: torch.fx.GraphModule, program) -> int:
    """Rewrite every float ``native_layer_norm`` of ``graph_module`` whose weight or bias
    ``program`` trains; returns how many."""
    return rewrite_each(
        graph_module,
        nodes.edge_aten().native_layer_norm.default,
        _rewrite,
        accept=lambda node: _trains(node, program),
    )


class TrainableLayerNorms(OptionGatedPass):
    """to_edge transform pass running ``rewrite_trainable_layer_norms``, always."""

    def enabled(self, options) -> bool:
        return True

    def rewrite(self, graph_module: torch.fx.GraphModule) -> int:
        return rewrite_trainable_layer_norms(graph_module, self.edge_program)
