"""Multiplications by a scalar constant that fp16 cannot hold, as two exact factors.

On the HTP every constant of an fp16 graph is an fp16 number. ``x * (1/6)``
then multiplies by 0.16663, 2.4e-4 below 1/6, on every element: the output's
least-squares gain against fp32 is -2.1e-4 where torch's float16 op (which
multiplies by the fp32 scalar and rounds once) has 1e-6; ``x / 3`` is the same
on the HTP (SM8650, QAIRT 2.51; ``tests/test_scalar_constants.py``,
docs/numerics.md). Rounding noise averages out through a network; a gain does
not. MobileNetV3's hardswish and hardsigmoid (``passes/hardswish.py``'s
``x / 6``) and their backward (``x / 3``, ``g / 6``) carry it: on the HTP,
MobileNetV3-Small's features at 64 px drift to a gain of -3.8e-3 by block 10
and 1.19x torch fp16's relative L2 (paired: -2.9e-3 and 0.99x).

``PairedScalars`` (option ``scalar_constants="paired"``, the default) rewrites
``x * c`` and ``x / k`` (``c = 1 / k``) for a one-element constant whose value
fp16 does not hold exactly as ``(x * a) * b``: ``a`` and ``b`` are fp16 numbers
whose product is ``c`` to about 1e-6 (``a`` in [0.5, 1), so neither product
overflows where ``x * c`` does not), picked among such pairs for the smallest
gain of the two roundings over fixed samples of fp16 inputs (1/6: gain 6e-6 on
the HTP, against -2.1e-4). The cost is one more element-wise multiplication per
rewritten node. A constant the program reads as a parameter or a buffer it
mutates is not a constant and is left alone, and so are powers of two and
constants whose pair would fall outside fp16's normal range.
"""

from __future__ import annotations

import functools
import logging

import torch

from .. import integration
from .gated import OptionGatedPass
from .graph_builder import NodeBuilder
from .hardswish import _scalar

logger = logging.getLogger(__name__)

# A pair's product may differ from the constant by this much (relative); the
# fp16 rounding of a constant is up to 4.9e-4 off, and fp32 nodes left on CPU
# compute the pair's product to this accuracy.
PAIR_TOLERANCE = 1e-6

# The smallest normal fp16 magnitude: a factor below it loses precision.
_FP16_TINY = 2.0**-14
_FP16_MAX = 65504.0


def _fp16(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float64).to(torch.float16))


@functools.lru_cache(maxsize=1)
def _samples() -> tuple[torch.Tensor, ...]:
    """fp16-representable inputs of several spreads, as float64 (fixed seed)."""
    generator = torch.Generator().manual_seed(0)
    n = 1 << 15
    draws = (
        torch.rand(n, generator=generator) + 0.5,
        3 * torch.randn(n, generator=generator),
        torch.exp(torch.rand(n, generator=generator) * 12 - 6)
        * torch.randn(n, generator=generator).sign(),
    )
    return tuple(d.to(torch.float16).double() for d in draws)


def _gain(a: float, b: float, c: float) -> float:
    """The worst |gain - 1| of ``fp16(fp16(x * a) * b)`` against ``x * c`` over the samples."""
    worst = 0.0
    for x in _samples():
        y = (x * a).to(torch.float16).double() * b
        y = y.to(torch.float16).double()
        r = x * c
        worst = max(worst, abs((y @ r / (r @ r)).item() - 1.0))
    return worst


@functools.lru_cache(maxsize=256)
def fp16_pair(c: float) -> tuple[float, float] | None:
    """``(a, b)``, fp16 numbers with ``a * b == c`` to ``PAIR_TOLERANCE``, or None.

    None when fp16 holds ``c`` exactly (or it is 0 or not finite) or no pair
    with both factors normal fp16 numbers exists. Among the pairs, the one whose
    two roundings have the smallest gain over ``_samples()``.
    """
    if c == 0 or not torch.isfinite(torch.tensor(c)) or _fp16(c) == c:
        return None
    magnitude = abs(c)
    candidates = []
    for mantissa in range(1024):
        a = 0.5 + mantissa / 2048  # every fp16 number in [0.5, 1)
        b = _fp16(magnitude / a)
        if not _FP16_TINY <= b <= _FP16_MAX:
            continue
        if abs(a * b - magnitude) <= PAIR_TOLERANCE * magnitude:
            candidates.append((a, b))
    if not candidates:
        return None
    a, b = min(candidates, key=lambda pair: _gain(pair[0], pair[1], magnitude))
    return a, (b if c > 0 else -b)


def _is_float(node: object) -> bool:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dtype.is_floating_point


def _factor(node: torch.fx.Node, ops, edge_program) -> tuple[torch.fx.Node, object, float] | None:
    """``(x, k, c)`` when ``node`` is ``x * c`` or ``x / k`` (``c = 1 / k``) for a constant."""
    if not _is_float(node) or len(node.args) != 2:
        return None
    if node.target in (ops.mul.Tensor, ops.mul.Scalar):
        orders = (node.args, node.args[::-1])
        invert = False
    elif node.target in (ops.div.Tensor, ops.div.Scalar):
        if node.kwargs.get("rounding_mode") is not None:
            return None
        orders = (node.args,)
        invert = True
    else:
        return None
    for x, k in orders:
        if not isinstance(x, torch.fx.Node) or _scalar(x, edge_program) is not None:
            continue
        value = _scalar(k, edge_program)
        if value is None or value == 0:
            continue
        return x, k, (1.0 / value if invert else value)
    return None


def pair_scalar_constants(graph_module: torch.fx.GraphModule, edge_program=None) -> int:
    """Rewrite each ``x * c`` / ``x / k`` with an fp16-inexact constant; returns how many.

    ``edge_program`` resolves lifted constants; without it only Python scalars
    and ``get_attr`` constants are recognised (``hardswish._scalar``).
    """
    ops = integration.get("ops").edge.aten
    changed = 0
    for node in list(graph_module.graph.nodes):
        if node.op != "call_function":
            continue
        found = _factor(node, ops, edge_program)
        if found is None:
            continue
        x, k, c = found
        pair = fp16_pair(c)
        if pair is None:
            continue
        b = NodeBuilder(graph_module, node)
        dtype = node.meta["val"].dtype
        first = b.call(ops.mul.Tensor, x, b.constant("a", torch.tensor([pair[0]], dtype=dtype)))
        out = b.call(ops.mul.Tensor, first, b.constant("b", torch.tensor([pair[1]], dtype=dtype)))
        node.replace_all_uses_with(out)
        graph_module.graph.erase_node(node)
        while isinstance(k, torch.fx.Node) and k.op == "call_function" and not k.users:
            source = k.args[0] if k.args else None  # a reshape or copy of the constant
            graph_module.graph.erase_node(k)
            k = source
        changed += 1
    if changed:
        graph_module.recompile()
    return changed


class PairedScalars(OptionGatedPass):
    """to_edge transform pass running ``pair_scalar_constants`` (options.scalar_constants)."""

    def enabled(self, options) -> bool:
        return options.scalar_constants == "paired"

    def rewrite(self, graph_module: torch.fx.GraphModule) -> int:
        changed = pair_scalar_constants(graph_module, self.edge_program)
        if changed:
            logger.info(
                "scalar constants: %d multiplications by a constant fp16 cannot hold "
                "made two exact factors",
                changed,
            )
        return changed
