"""Adaptive average pools and their backwards as products with averaging matrices.

Along each spatial axis an adaptive average pool from ``In`` to ``Out`` elements is a
fixed linear map: output ``i`` averages the inputs ``[start_i, end_i)``
(``geometry.pool.adaptive_windows``), the matrix ``A`` of shape ``[Out, In]`` with
``A[i, j] = 1 / (end_i - start_i)`` on that range. So, per plane::

    forward   out     = A_h @ x @ A_w^T
    backward  grad_in = A_h^T @ grad_out @ A_w

executorch's QNN backend has no visitor for ``_adaptive_avg_pool2d`` (the op a
joint graph holds; its ``adaptive_avg_pool2d`` visitor takes only sizes that divide)
nor for its backward, for which executorch 1.5.1's runtime has no CPU kernel
either (VGG's ``AdaptiveAvgPool2d((7, 7))`` meets a 1x1 map at 32 px).
``AdaptivePoolsAsProducts`` writes both as ``mm`` with the static matrices over
the planes flattened into rows, with a ``permute_copy`` to bring the height axis
last; an axis whose matrix is the identity (``In == Out``) is skipped. Every output
is a sum of its window's inputs each times ``1 / len``: the same average as ATen's
up to rounding (``tests/test_adaptive_pool.py`` compares them in float64).
"""

from __future__ import annotations

import math

import torch

from .. import nodes
from ..geometry import pool as pg
from ..partition.rewrites import adaptive_pool_refusal
from .gated import OptionGatedPass
from .graph_builder import NodeBuilder, rewrite_each


def averaging_matrix(in_size: int, out_size: int, dtype: torch.dtype) -> torch.Tensor:
    """``A`` of shape ``[out_size, in_size]``: row ``i`` averages output ``i``'s window."""
    matrix = torch.zeros(out_size, in_size, dtype=torch.float64)
    for i, (start, end) in enumerate(pg.adaptive_windows(in_size, out_size)):
        matrix[i, start:end] = 1.0 / (end - start)
    return matrix.to(dtype)


def _products(
    b: NodeBuilder, x: torch.fx.Node, out_hw: tuple[int, int], forward: bool
) -> torch.fx.Node:
    """``x`` ``[*lead, H, W]`` mapped to ``[*lead, *out_hw]`` by the averaging matrices
    (``forward``) or their transposes (the backward, ``x`` the gradient of the output)."""
    ops = b.ops
    shape = list(x.meta["val"].shape)
    lead, (h, w) = shape[:-2], shape[-2:]
    rows = math.prod(lead)
    dtype = x.meta["val"].dtype
    oh, ow = out_hw

    def right_factor(name: str, size: int, out: int) -> torch.fx.Node:
        # x @ M along the last axis: M = A^T (forward, A: [out, size]) or A (backward,
        # A: [size, out], the forward's matrix from out to size).
        if forward:
            matrix = averaging_matrix(size, out, dtype).T
        else:
            matrix = averaging_matrix(out, size, dtype)
        return b.constant(name, matrix.contiguous())

    y = b.call(ops.view_copy.default, x, [rows, h, w])
    if w != ow:  # along W: [rows * h, w] @ [w, ow]
        flat = b.call(ops.view_copy.default, y, [rows * h, w])
        product = b.call(ops.mm.default, flat, right_factor("width", w, ow))
        y = b.call(ops.view_copy.default, product, [rows, h, ow])
    if h != oh:  # along H, brought last: [rows * ow, h] @ [h, oh]
        turned = b.call(ops.permute_copy.default, y, [0, 2, 1])
        flat = b.call(ops.view_copy.default, turned, [rows * ow, h])
        product = b.call(ops.mm.default, flat, right_factor("height", h, oh))
        y = b.call(
            ops.permute_copy.default,
            b.call(ops.view_copy.default, product, [rows, ow, oh]),
            [0, 2, 1],
        )
    return b.call(ops.view_copy.default, y, [*lead, oh, ow])


def _rewrite_forward(graph_module: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    out_hw = tuple(node.meta["val"].shape[-2:])
    out = _products(NodeBuilder(graph_module, node), node.args[0], out_hw, forward=True)
    node.replace_all_uses_with(out)
    graph_module.graph.erase_node(node)


def _rewrite_backward(graph_module: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    grad_output = node.args[0]
    in_hw = tuple(node.meta["val"].shape[-2:])
    out = _products(NodeBuilder(graph_module, node), grad_output, in_hw, forward=False)
    node.replace_all_uses_with(out)
    graph_module.graph.erase_node(node)


def rewrite_adaptive_pools(graph_module: torch.fx.GraphModule) -> int:
    """Rewrite every floating-point ``_adaptive_avg_pool2d`` and
    ``_adaptive_avg_pool2d_backward`` of ``graph_module`` with static shapes; returns how
    many."""
    ops = nodes.edge_aten()

    def static(node: torch.fx.Node) -> bool:
        return adaptive_pool_refusal(node) is None

    return rewrite_each(
        graph_module, ops._adaptive_avg_pool2d.default, _rewrite_forward, accept=static
    ) + rewrite_each(
        graph_module, ops._adaptive_avg_pool2d_backward.default, _rewrite_backward, accept=static
    )


class AdaptivePoolsAsProducts(OptionGatedPass):
    """to_edge transform pass running ``rewrite_adaptive_pools``, always."""

    def enabled(self, options) -> bool:
        return True

    def rewrite(self, graph_module: torch.fx.GraphModule) -> int:
        return rewrite_adaptive_pools(graph_module)
