"""``a * (z + k)`` as ``a * z + a * k`` for the HTP (``k`` a scalar constant).

On the HTP (QAIRT 2.51, fp16) an ElementWiseMultiply reading the output of an
ElementWiseAdd of a constant is biased: ``a * (s + 0.5)`` with ``a = 3 * randn``
and ``s`` uniform on [0, 1] comes out 1.8e-4 too large on average (the
least-squares gain of the output against fp32 minus one; torch fp16 -6.7e-6),
while ``a * s`` and ``a * (s * 0.5)`` are bit-identical to torch fp16
(SM8650, docs/numerics.md). The relative L2 of one such op is at the fp16
floor; the bias is not, and it does not average out through a network: the
tanh form of sigmoid (``passes/sigmoid.py``, ``0.5 * tanh(x / 2) + 0.5``)
feeds every SiLU and squeeze-excitation gate of EfficientNet-B0 into a
multiplication, and its forward logits drifted to 2.5x torch fp16's relative L2,
most of it a gain of +2.3 % by block 12.

``DistributeMul`` (option ``mul_over_add="distribute"``, the default) rewrites
each floating-point ``mul(a, add(z, k))`` of the edge program before
partitioning, for ``k`` a Python scalar or a one-element tensor the graph reads
(a constant, lifted or not; ``k``'s node is reused, so no value is baked in). The
multiplication by ``k`` is exact for the powers of two the sigmoid rewrite uses
(SiLU becomes ``x * (t * 0.5) + x * 0.5`` with ``t = tanh(x / 2)``). The ``add``
stays for its other readers.
"""

from __future__ import annotations

import logging

import torch

from .gated import OptionGatedPass
from .graph_builder import NodeBuilder

logger = logging.getLogger(__name__)


# Ops that only reshape their input: a one-element input behind them is still one.
_RESHAPES = ("view_copy", "unsqueeze_copy", "squeeze_copy", "alias_copy", "expand_copy")


def _is_scalar_input(node: object) -> bool:
    """A one-element tensor the graph reads (constant, buffer, parameter), maybe reshaped.

    executorch's passes turn a lifted 0-d constant into ``view_copy(c, (1, 1, 1, 1))``.
    """
    if not isinstance(node, torch.fx.Node):
        return False
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.numel() != 1:
        return False
    if node.op in ("get_attr", "placeholder"):
        return True
    reshape = node.op == "call_function" and any(
        f"aten.{name}." in str(node.target) for name in _RESHAPES
    )
    return reshape and _is_scalar_input(node.args[0])


def _split_sum(node: object, ops) -> tuple[torch.fx.Node, object] | None:
    """``(z, k)`` when ``node`` computes ``z + k`` for a scalar or a one-element input ``k``."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    if node.kwargs.get("alpha", 1) != 1 or len(node.args) != 2:
        return None
    if node.target == ops.add.Scalar:
        z, k = node.args
        return (z, k) if isinstance(z, torch.fx.Node) else None
    if node.target == ops.add.Tensor:
        for z, k in (node.args, node.args[::-1]):
            if _is_scalar_input(k) and isinstance(z, torch.fx.Node) and not _is_scalar_input(z):
                return z, k
    return None


def _is_float(node: object) -> bool:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dtype.is_floating_point


def _distribute_once(graph_module: torch.fx.GraphModule, ops) -> int:
    changed = 0
    for node in list(graph_module.graph.nodes):
        if node.op != "call_function" or node.target != ops.mul.Tensor or not _is_float(node):
            continue
        for index in (1, 0):
            a, sum_node = node.args[1 - index], node.args[index]
            split = _split_sum(sum_node, ops)
            if split is None or not _is_float(a) or a.op == "get_attr" or _is_scalar_input(a):
                continue
            z, k = split
            b = NodeBuilder(graph_module, node)
            if not isinstance(k, torch.fx.Node):
                k = b.constant("k", torch.tensor([k], dtype=node.meta["val"].dtype))
            product = b.call(ops.mul.Tensor, a, z)
            out = b.call(ops.add.Tensor, product, b.call(ops.mul.Tensor, a, k))
            node.replace_all_uses_with(out)
            graph_module.graph.erase_node(node)
            if not sum_node.users:
                graph_module.graph.erase_node(sum_node)
            changed += 1
            break
    return changed


def distribute_mul(graph_module: torch.fx.GraphModule) -> int:
    """Rewrite every floating-point ``mul(a, z + k)`` into ``a * z + a * k``; returns how many.

    ``a`` is no constant and no one-element input. A product of two
    such sums (``s * (1 + x * (1 - s))`` in SiLU's backward) is distributed over
    both: the new ``a * z`` is rewritten again.
    """
    from .. import integration

    ops = integration.get("ops").edge.aten
    changed = 0
    while True:
        more = _distribute_once(graph_module, ops)
        if not more:
            break
        changed += more
    if changed:
        graph_module.recompile()
    return changed


class DistributeMul(OptionGatedPass):
    """to_edge transform pass running ``distribute_mul`` (options.mul_over_add)."""

    def enabled(self, options) -> bool:
        return options.mul_over_add == "distribute"

    def rewrite(self, graph_module: torch.fx.GraphModule) -> int:
        changed = distribute_mul(graph_module)
        if changed:
            logger.info(
                "mul over add: %d multiplications of a sum with a constant distributed", changed
            )
        return changed
