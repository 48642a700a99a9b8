"""``aten.erf`` as ops the HTP runs: GELU's backward on the HTP.

A training graph keeps a forward ``aten.gelu`` whole (executorch lowers it to QNN's
Gelu) but decomposes its backward, ``grad * (cdf + x * pdf)`` with
``cdf = 0.5 * (1 + erf(x / sqrt(2)))``; executorch's QNN backend has no visitor for
``erf``, so before this rewrite that one op per GELU stayed on CPU (ConvNeXt-Tiny:
18), a delegate boundary in every block's backward. ``ErfAsPolynomials`` writes
every floating-point ``erf`` as::

    |x| < 1:  (2 / sqrt(pi)) * x * sum_k (-1)^k x^(2k) / (k! (2k + 1)),  k = 0 .. 7
    |x| >= 1: sign(x) * (1 - t * P(t) * exp(-x^2)),  t = 1 / (1 + 0.3275911 |x|)

(the Maclaurin series, truncated after x^15: at most 1.3e-5 off at |x| = 1; and
Abramowitz and Stegun's 7.1.26 rational approximation, at most 1.5e-7 off), joined
by a ``where`` on ``|x| < 1``. ``t`` is a division, not ``aten.reciprocal``: QNN's
ElementWiseUnary, executorch's visitor for a reciprocal, takes no float operand on
the HTP (QAIRT's op validation: "operation 'Reciprocal' does not support FLOAT16 or
FLOAT32 datatype"), so a reciprocal would stay on CPU, a delegate boundary in every
GELU's backward; ElementWiseDivide takes fp16. In fp32 (on CPU) it is within 1.6e-6
of ``erf``; in fp16 each op's rounding makes it at most about 2 fp16 units in the
last place off, its mean error at most 1.6x that of torch's own fp16 ``erf`` and
unbiased (``tests/test_gelu.py`` measures it with torch's fp16 ops, checks that QNN's
op validation takes every op of the rewrite, and checks GELU's forward and backward
on the simulator).
The tanh form of GELU needs no rewrite: its backward is tanh and products.
"""

from __future__ import annotations

import math

import torch

from .. import nodes
from .gated import OptionGatedPass
from .graph_builder import NodeBuilder, rewrite_each

# Maclaurin coefficients of erf(x) * sqrt(pi) / 2, in powers of x^2.
SERIES = tuple((-1) ** k / (math.factorial(k) * (2 * k + 1)) for k in range(8))
# Abramowitz and Stegun 7.1.26: p and a1 .. a5.
P = 0.3275911
RATIONAL = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)
SWITCH = 1.0  # |x| below: the series


def erf_reference(x: torch.Tensor) -> torch.Tensor:
    """The rewrite's function in torch ops of ``x``'s dtype, op for op as the graph has it
    (the tests run it in fp16 to measure what rounding every op costs)."""
    dtype = x.dtype

    def k(value: float) -> torch.Tensor:
        return torch.tensor([value], dtype=dtype)

    a = torch.abs(x)
    square = x * x
    series = k(SERIES[-1])
    for coefficient in reversed(SERIES[:-1]):
        series = series * square + k(coefficient)
    near = x * series * k(2 / math.sqrt(math.pi))
    t = torch.div(k(1.0), a * k(P) + k(1.0))
    poly = k(RATIONAL[-1])
    for coefficient in reversed(RATIONAL[:-1]):
        poly = poly * t + k(coefficient)
    far = torch.sign(x) * (k(1.0) - poly * t * torch.exp(torch.neg(square)))
    return torch.where(torch.lt(a, k(SWITCH)), near, far)


def _rewrite(graph_module: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    (x,) = node.args
    b = NodeBuilder(graph_module, node)
    ops = b.ops
    dtype = x.meta["val"].dtype
    made: dict[float, torch.fx.Node] = {}

    def k(name: str, value: float) -> torch.fx.Node:
        if value not in made:
            made[value] = b.constant(name, torch.tensor([value], dtype=dtype))
        return made[value]

    a = b.call(ops.abs.default, x)
    square = b.call(ops.mul.Tensor, x, x)
    series = k("s7", SERIES[-1])
    for number, coefficient in reversed(list(enumerate(SERIES[:-1]))):
        series = b.call(
            ops.add.Tensor, b.call(ops.mul.Tensor, series, square), k(f"s{number}", coefficient)
        )
    near = b.call(
        ops.mul.Tensor, b.call(ops.mul.Tensor, x, series), k("scale", 2 / math.sqrt(math.pi))
    )
    t = b.call(
        ops.div.Tensor,
        k("one", 1.0),
        b.call(ops.add.Tensor, b.call(ops.mul.Tensor, a, k("p", P)), k("one", 1.0)),
    )
    poly = k("a5", RATIONAL[-1])
    for number, coefficient in reversed(list(enumerate(RATIONAL[:-1]))):
        poly = b.call(
            ops.add.Tensor, b.call(ops.mul.Tensor, poly, t), k(f"a{number + 1}", coefficient)
        )
    decay = b.call(ops.exp.default, b.call(ops.neg.default, square))
    tail = b.call(
        ops.sub.Tensor,
        k("one", 1.0),
        b.call(ops.mul.Tensor, b.call(ops.mul.Tensor, poly, t), decay),
    )
    far = b.call(ops.mul.Tensor, b.call(ops.sign.default, x), tail)
    near_zero = b.call(ops.lt.Tensor, a, k("switch", SWITCH))
    out = b.call(ops.where.self, near_zero, near, far)
    node.replace_all_uses_with(out)
    graph_module.graph.erase_node(node)


def rewrite_erfs(graph_module: torch.fx.GraphModule) -> int:
    """Rewrite every floating-point ``aten.erf`` of ``graph_module``; returns how many."""
    return rewrite_each(graph_module, nodes.edge_aten().erf.default, _rewrite)


class ErfAsPolynomials(OptionGatedPass):
    """to_edge transform pass running ``rewrite_erfs``, always (no option switches it)."""

    def enabled(self, options) -> bool:
        return True

    def rewrite(self, graph_module: torch.fx.GraphModule) -> int:
        return rewrite_erfs(graph_module)
