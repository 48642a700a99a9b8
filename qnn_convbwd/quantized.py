"""Gradients through a pt2e-quantized model: the straight-through estimator.

A model converted with pt2e (``prepare_pt2e`` / ``convert_pt2e``) computes every
activation as ``dequantize_per_tensor(quantize_per_tensor(x))``. The quantize returns
an integer tensor, so no gradient flows through it: a trainable parameter before or
inside the quantized part gets none, and
``torch.export.experimental._export_forward_backward`` fails with "Found a parameter
that did not receive a gradient".

``straight_through(module)`` replaces each such pair by ``straight_through_quantize``
(the op ``qnn_convbwd::straight_through_quantize``) with the pair's parameters. Its
forward runs the pair itself, so its values are the pair's bit for bit; its backward
is quantization-aware training's straight-through estimator, the backward of
``torch.fake_quantize_per_tensor_affine``: the gradient passes where
``round(x / scale) + zero_point`` lies inside ``[quant_min, quant_max]`` and is zero
where the quantize clamps (``straight_through_bounds``: the same mask, exactly).
``torch.fake_quantize_per_tensor_affine`` itself is not used: its forward differs from
the pair at rounding ties (it multiplies by ``1.0f / float(scale)``, the quantize by
``float(1.0 / scale)``; measured on 310 tie points of one scale, 110 came out one step
apart). Weights stay ``dequantize_per_channel`` of their integer constants: frozen,
no gradient.

``training.lower_for_training`` applies it to a copy of the module it is given when
the module holds such pairs; ``passes.straight_through`` turns the op in the joint graph
back into the quantize / dequantize pair executorch's Qualcomm passes fold into
quantization metadata, so the forward stays on the HTP's integer path; the backward is
already comparisons and a select.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

# The full 8- and 16-bit ranges the estimator takes, each with its integer dtype (a
# quantizer may store a range in a wider dtype: QnnQuantizer's 16-bit activations are
# int32 tensors over [0, 65535]).
RANGE_DTYPES: dict[tuple[int, int], torch.dtype] = {
    (0, 255): torch.uint8,
    (-128, 127): torch.int8,
    (0, 65535): torch.uint16,
    (-32768, 32767): torch.int16,
}


class StraightThroughError(ValueError):
    """A quantize / dequantize pair the straight-through rewrite cannot take."""


def _quantize_ops() -> tuple | None:
    """pt2e's quantize and dequantize ops, as whoever converted the model registered
    them (torchao, or torch.ao: their kernels differ); None when none did."""
    ops = torch.ops.quantized_decomposed
    try:
        return ops.quantize_per_tensor.default, ops.dequantize_per_tensor.default
    except AttributeError:
        return None


def _graph_modules(module: torch.nn.Module) -> list[torch.fx.GraphModule]:
    return [m for m in module.modules() if isinstance(m, torch.fx.GraphModule)]


def activation_pairs(module: torch.nn.Module) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """Every (quantize_per_tensor, dequantize_per_tensor) pair of the graph modules in
    ``module`` (a dequantize reading a quantize)."""
    found = _quantize_ops()
    if found is None:
        return []
    quantize, dequantize = found
    return [
        (node.args[0], node)
        for graph_module in _graph_modules(module)
        for node in graph_module.graph.nodes
        if node.op == "call_function"
        and node.target == dequantize
        and isinstance(node.args[0], torch.fx.Node)
        and node.args[0].target == quantize
    ]


def _parameters(quantize: torch.fx.Node, dequantize: torch.fx.Node) -> tuple:
    """(scale, zero_point, quant_min, quant_max) of a pair, checked."""
    q_args, dq_args = tuple(quantize.args[1:6]), tuple(dequantize.args[1:6])
    if q_args != dq_args:
        raise StraightThroughError(
            f"{dequantize.name}: dequantizes {quantize.name} with other parameters "
            f"({list(dq_args)} against {list(q_args)})"
        )
    scale, zero_point, quant_min, quant_max, dtype = q_args
    holds = (
        isinstance(dtype, torch.dtype)
        and not dtype.is_floating_point
        and dtype != torch.bool
        and torch.iinfo(dtype).min <= quant_min
        and quant_max <= torch.iinfo(dtype).max
    )
    if (quant_min, quant_max) not in RANGE_DTYPES or not holds:
        known = ", ".join(f"[{lo}, {hi}]" for lo, hi in RANGE_DTYPES)
        raise StraightThroughError(
            f"{quantize.name}: {dtype} over [{quant_min}, {quant_max}] is not a full 8- or "
            f"16-bit range the lowering knows ({known}) in an integer dtype that holds it"
        )
    if not isinstance(scale, float) or not isinstance(zero_point, int):
        raise StraightThroughError(
            f"{quantize.name}: scale and zero point must be numbers of the graph, "
            f"not {type(scale).__name__} and {type(zero_point).__name__}"
        )
    return scale, zero_point, quant_min, quant_max


def straight_through(module: torch.nn.Module) -> int:
    """Replace, in place, each activation's quantize / dequantize pair of the pt2e graph
    modules in ``module`` with ``straight_through_quantize`` (the same forward values;
    the straight-through estimator's backward). Returns how many pairs.

    Every pair is checked before anything changes; a pair with different parameters on
    its two halves, a range other than a full 8- or 16-bit one, or tensor-valued
    parameters raises ``StraightThroughError`` naming the node. A quantize whose value is
    read by anything but dequantizes is refused the same way (that reader would need
    the integer tensor).
    """
    pairs = activation_pairs(module)
    plans = {}
    for quantize, dequantize in pairs:
        others = [u.name for u in quantize.users if u.target != dequantize.target]
        if others:
            raise StraightThroughError(
                f"{quantize.name}: its integer tensor is also read by {others}"
            )
        plans[dequantize] = _parameters(quantize, dequantize)
    changed = set()
    for (quantize, dequantize), parameters in zip(pairs, plans.values()):
        graph = dequantize.graph
        low, high = straight_through_bounds(*parameters)
        with graph.inserting_before(dequantize):
            fake = graph.call_function(
                torch.ops.qnn_convbwd.straight_through_quantize.default,
                (quantize.args[0], *parameters, quantize.args[5], low, high),
            )
        fake.meta.update({k: v for k, v in dequantize.meta.items() if k != "val"})
        if "val" in dequantize.meta:
            fake.meta["val"] = dequantize.meta["val"]
        dequantize.replace_all_uses_with(fake)
        graph.erase_node(dequantize)
        if not quantize.users:
            graph.erase_node(quantize)
        changed.add(graph)
    for graph_module in _graph_modules(module):
        if graph_module.graph in changed:
            graph_module.recompile()
    if pairs:
        logger.info("straight-through estimator: %d quantize / dequantize pairs", len(pairs))
    return len(pairs)


def holds_activation_pairs(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds pt2e activation quantize / dequantize pairs."""
    return bool(activation_pairs(module))


def _in_range(values: torch.Tensor, scale: float, zero_point: int, quant_min: int, quant_max: int):
    """torch's own straight-through mask of ``values`` (fp32)."""
    _, mask = torch.ops.aten.fake_quantize_per_tensor_affine_cachemask.default(
        values, scale, zero_point, quant_min, quant_max
    )
    return mask


def _first_float_where(predicate, around: float, rising: bool) -> float:
    """The smallest fp32 value near ``around`` where ``predicate`` turns True (``rising``)
    or the largest where it is still True (not ``rising``); ``predicate`` is monotone."""
    width = 64
    while True:
        centre = torch.tensor(around, dtype=torch.float32)
        steps = torch.arange(-width, width + 1, dtype=torch.int32)
        bits = centre.view(torch.int32) + steps  # neighbouring fp32 values
        values = bits.view(torch.float32).sort().values
        inside = predicate(values)
        if rising and not inside[0] and inside[-1]:
            return float(values[int(inside.int().argmax())])
        if not rising and inside[0] and not inside[-1]:
            return float(values[int((~inside).int().argmax()) - 1])
        width *= 4
        if width > 1 << 24:
            raise StraightThroughError(f"no fp32 bound of the quantize range near {around}")


def straight_through_bounds(
    scale: float, zero_point: int, quant_min: int, quant_max: int
) -> tuple[float, float]:
    """``(low, high)``: the fp32 interval where the straight-through estimator passes the
    gradient. For every finite fp32 ``x``, ``low <= x <= high`` exactly when torch's
    ``fake_quantize_per_tensor_affine`` leaves ``x`` unclamped
    (``quant_min <= round(x / scale) + zero_point <= quant_max``, computed as torch
    computes it)."""

    def inside(values: torch.Tensor) -> torch.Tensor:
        return _in_range(values, scale, zero_point, quant_min, quant_max)

    low = _first_float_where(inside, (quant_min - zero_point - 0.5) * scale, rising=True)
    high = _first_float_where(inside, (quant_max - zero_point + 0.5) * scale, rising=False)
    return low, high


# --- the op -------------------------------------------------------------------------------


@torch.library.custom_op("qnn_convbwd::straight_through_quantize", mutates_args=())
def straight_through_quantize(
    x: torch.Tensor,
    scale: float,
    zero_point: int,
    quant_min: int,
    quant_max: int,
    dtype: torch.dtype,
    low: float,
    high: float,
) -> torch.Tensor:
    """``dequantize_per_tensor(quantize_per_tensor(x))`` with pt2e's ops; its gradient is
    the incoming one where ``low <= x <= high`` (``straight_through_bounds``), else 0."""
    quantize, dequantize = _quantize_ops()
    parameters = (scale, zero_point, quant_min, quant_max, dtype)
    return dequantize(quantize(x, *parameters), *parameters)


@straight_through_quantize.register_fake
def _(x, scale, zero_point, quant_min, quant_max, dtype, low, high):
    return torch.empty_like(x)


def _setup(ctx, inputs, output) -> None:
    x, *_, low, high = inputs
    ctx.save_for_backward(x)
    ctx.low, ctx.high = low, high


def _backward(ctx, grad: torch.Tensor):
    (x,) = ctx.saved_tensors
    inside = torch.logical_and(torch.ge(x, ctx.low), torch.le(x, ctx.high))
    passed = torch.where(inside, grad, torch.zeros((), dtype=grad.dtype))
    return passed, None, None, None, None, None, None, None


straight_through_quantize.register_autograd(_backward, setup_context=_setup)
