"""Hardswish and hardsigmoid centred on zero for the HTP.

A training graph holds autograd's decomposition of ``aten.hardswish`` and
``aten.hardsigmoid``, not the ops: ``x * clamp(x + 3, 0, 6) / 6`` and
``clamp(x + 3, 0, 6) / 6`` (``add``, two ``clamp``, ``mul``, ``div`` by a lifted
constant). On the HTP (QAIRT 2.51, fp16) that form is 1.5x less accurate than
torch's float16 op and biased low (hardswish: relative L2 3.5e-4 against 2.4e-4,
least-squares gain - 1 of -1.0e-4; hardsigmoid 2.4e-4 against 1.6e-4, gain -5.9e-5;
``3 * randn`` inputs, SM8650, docs/numerics.md); QNN's own HardSwish op
(executorch's ``op_hardswish`` visitor, an inference graph) is 1.57x.

The same functions centred on zero,

    hardsigmoid(x) = clamp(x / 6, -1/2, 1/2) + 1/2
    hardswish(x)   = x / 2 + x * clamp(x / 6, -1/2, 1/2)

measure 1.12x and 1.08x the fp16 floor with a gain of +2e-5 / -1.6e-5, and a
squeeze-excitation gate ``a * hardsigmoid(b)`` 1.03x (1.19x before) once
``passes/distribute_mul.py`` has turned it into ``a * clamp(..) + a * 1/2``
(this pass runs before it). Multiplications by 1/2 are exact.

``CentredHardActivations`` (option ``hardswish="centred"``, the default;
``"executorch"`` leaves the graph) rewrites, before partitioning, every
floating-point ``aten.hardswish`` / ``aten.hardsigmoid`` and every instance of
their decomposition above (the constants 3 and 6 read as Python scalars or
one-element constants). Nodes left on CPU compute the same function in fp32
(to ~4e-8). The backward (``where`` masks, ``g * (x / 3 + 1/2)`` and
``g * (1/6)``) is left as autograd wrote it: its remaining error is the fp16
rounding of 1/3 and 1/6 (docs/numerics.md).
"""

from __future__ import annotations

import logging

import torch

from .. import integration
from .gated import OptionGatedPass
from .graph_builder import NodeBuilder

logger = logging.getLogger(__name__)

# Ops that only move or cast a one-element constant (executorch's passes put a
# ``_to_dim_order_copy`` to fp32 and reshapes between a lifted 0-d constant and its reader).
_TRANSPARENT = (
    "_to_dim_order_copy",
    "view_copy",
    "unsqueeze_copy",
    "squeeze_copy",
    "alias_copy",
    "expand_copy",
)


def _scalar(value: object, edge_program) -> float | None:
    """The value of a Python number or of a one-element constant the graph reads."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, torch.fx.Node):
        return None
    val = value.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.numel() != 1:
        return None
    if value.op == "call_function":
        if any(f".{name}." in str(value.target) for name in _TRANSPARENT) and value.args:
            return _scalar(value.args[0], edge_program)
        return None
    if value.op == "get_attr":
        return float(integration.get("get_parameter")(value, edge_program).float().item())
    constant = _constant_input(value, edge_program)
    return None if constant is None else float(constant.float().reshape(-1)[0])


def _constant_input(node: torch.fx.Node, edge_program) -> torch.Tensor | None:
    """The value of a lifted tensor constant or of a buffer the program does not mutate.

    The joint graph lists its lifted constants (the decomposition's 3 and 6) as
    buffers. Inside executorch's QNN pass manager the graph's placeholder names
    can differ from the signature's (``b__lifted_tensor_constant2`` for
    ``_lifted_tensor_constant2``): a placeholder is then matched by that name.
    Never by position: the graph's placeholders need not be in the signature's
    order (a train-mode forward program lists its constants after the running
    statistics), and a constant read from the wrong entry is a wrong number.
    """
    if edge_program is None or node.op != "placeholder":
        return None
    signature = edge_program.graph_signature
    spec = _input_spec(node, signature.input_specs)
    if spec is None:
        return None
    if spec.kind.name == "BUFFER" and spec.target in set(signature.buffers_to_mutate.values()):
        return None
    if spec.kind.name not in ("BUFFER", "CONSTANT_TENSOR"):
        return None
    value = {**edge_program.state_dict, **edge_program.constants}.get(spec.target)
    return value if isinstance(value, torch.Tensor) and value.numel() == 1 else None


def _input_spec(node: torch.fx.Node, specs) -> object | None:
    """The input spec of placeholder ``node``: by name, else the unique spec whose name
    or target, prefixed with ``b_`` as a buffer's placeholder is named, is the
    placeholder's."""
    found = next((s for s in specs if s.arg.name == node.name), None)
    if found is not None:
        return found
    renamed = [
        s for s in specs if node.name in (f"b_{s.arg.name}", f"b_{str(s.target).replace('.', '_')}")
    ]
    return renamed[0] if len(renamed) == 1 else None


def _is(node: object, target) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target == target


def _is_float(node: object) -> bool:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dtype.is_floating_point


def _close(value: float | None, expected: float) -> bool:
    return value is not None and abs(value - expected) <= 1e-6 * abs(expected)


def _clamp_bounds(node: torch.fx.Node) -> tuple[object, object]:
    args = list(node.args[1:]) + [None] * (3 - len(node.args))
    low = node.kwargs.get("min", args[0])
    high = node.kwargs.get("max", args[1])
    return low, high


def _relu6_of_shift(node: object, ops, edge_program) -> tuple[torch.fx.Node, list] | None:
    """``(x, nodes)`` when ``node`` is ``clamp(x + 3, 0, 6)`` (one clamp or two)."""
    chain, low, high = [], None, None
    while _is(node, ops.clamp.default) and len(chain) < 2:
        lo, hi = _clamp_bounds(node)
        if (lo is not None and low is not None) or (hi is not None and high is not None):
            return None
        low = lo if lo is not None else low
        high = hi if hi is not None else high
        chain.append(node)
        node = node.args[0]
    if not chain or not _close(_scalar(low, edge_program), 0.0):
        return None
    if not _close(_scalar(high, edge_program), 6.0):
        return None
    if not _is(node, ops.add.Tensor) and not _is(node, ops.add.Scalar):
        return None
    if node.kwargs.get("alpha", 1) != 1 or len(node.args) != 2:
        return None
    for x, k in (node.args, node.args[::-1]):
        if isinstance(x, torch.fx.Node) and _is_float(x) and _close(_scalar(k, edge_program), 3.0):
            if _scalar(x, edge_program) is None:
                return x, [*chain, node]
    return None


def _divided_by_six(node: torch.fx.Node, ops, edge_program) -> object | None:
    """The dividend when ``node`` is ``y / 6`` or ``y * (1/6)``."""
    if (_is(node, ops.div.Tensor) or _is(node, ops.div.Scalar)) and len(node.args) == 2:
        if node.kwargs.get("rounding_mode") is None and _close(
            _scalar(node.args[1], edge_program), 6.0
        ):
            return node.args[0]
    if _is(node, ops.mul.Tensor) or _is(node, ops.mul.Scalar):
        for y, k in (node.args, node.args[::-1]):
            if _close(_scalar(k, edge_program), 1 / 6) and _scalar(y, edge_program) is None:
                return y
    return None


def match(node: torch.fx.Node, ops, edge_program) -> tuple[str, torch.fx.Node, list] | None:
    """``(kind, x, matched nodes)`` for a hardswish / hardsigmoid of ``x`` ending at ``node``.

    ``kind`` is ``"hardswish"`` or ``"hardsigmoid"``; the matched nodes (without
    ``node``) may be erased once ``node`` is replaced and they have no other reader.
    """
    if node.op != "call_function" or not _is_float(node):
        return None
    if node.target == ops.hardswish.default:
        return "hardswish", node.args[0], []
    if node.target == ops.hardsigmoid.default:
        return "hardsigmoid", node.args[0], []
    dividend = _divided_by_six(node, ops, edge_program)
    if not isinstance(dividend, torch.fx.Node):
        return None
    found = _relu6_of_shift(dividend, ops, edge_program)
    if found is not None:
        return "hardsigmoid", found[0], found[1]
    if _is(dividend, ops.mul.Tensor) and len(dividend.args) == 2:
        for x, gate in (dividend.args, dividend.args[::-1]):
            found = _relu6_of_shift(gate, ops, edge_program)
            if found is not None and found[0] is x:
                return "hardswish", x, [dividend, *found[1]]
    return None


def _centred(b: NodeBuilder, x: torch.fx.Node, kind: str) -> torch.fx.Node:
    dtype = x.meta["val"].dtype
    half = b.constant("half", torch.tensor([0.5], dtype=dtype))
    sixth = b.constant("sixth", torch.tensor([1 / 6], dtype=dtype))
    clamped = b.call(b.ops.clamp.default, b.call(b.ops.mul.Tensor, x, sixth), -0.5, 0.5)
    if kind == "hardsigmoid":
        return b.call(b.ops.add.Tensor, clamped, half)
    return b.call(
        b.ops.add.Tensor, b.call(b.ops.mul.Tensor, x, half), b.call(b.ops.mul.Tensor, x, clamped)
    )


def centre_hard_activations(graph_module: torch.fx.GraphModule, edge_program=None) -> int:
    """Rewrite every floating-point hardswish / hardsigmoid (op or decomposition); returns how many.

    ``edge_program`` resolves lifted constants (the decomposition's 3 and 6);
    without it only Python-scalar and ``get_attr`` constants are recognised.
    """
    ops = integration.get("ops").edge.aten
    changed = 0
    for node in list(graph_module.graph.nodes):
        found = match(node, ops, edge_program)
        if found is None:
            continue
        kind, x, matched = found
        out = _centred(NodeBuilder(graph_module, node), x, kind)
        node.replace_all_uses_with(out)
        graph_module.graph.erase_node(node)
        for dead in matched:  # consumers first
            if not dead.users:
                graph_module.graph.erase_node(dead)
        changed += 1
    if changed:
        graph_module.recompile()
    return changed


class CentredHardActivations(OptionGatedPass):
    """to_edge transform pass running ``centre_hard_activations`` (options.hardswish)."""

    def enabled(self, options) -> bool:
        return options.hardswish == "centred"

    def rewrite(self, graph_module: torch.fx.GraphModule) -> int:
        changed = centre_hard_activations(graph_module, self.edge_program)
        if changed:
            logger.info("hardswish / hardsigmoid: %d rewritten centred on zero", changed)
        return changed
