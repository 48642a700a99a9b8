"""What kind of node this is: one helper per node kind the plugin looks for."""

from __future__ import annotations

import operator

import torch

from . import integration

# Operand positions (aten.convolution and aten.convolution_backward schemas).
CONV_WEIGHT, CONV_BIAS, CONV_TRANSPOSED = 1, 2, 6
CONV_BWD_WEIGHT = 2


def edge_aten():
    """executorch's edge-dialect ATen op handles (``exir_ops.edge.aten``)."""
    return integration.get("ops").edge.aten


def is_call(node: object, *targets) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def is_convolution(node: object) -> bool:
    """An edge-dialect forward ``aten.convolution``."""
    return is_call(node, edge_aten().convolution.default)


def is_conv_bwd(node: object) -> bool:
    """An edge-dialect or ATen ``convolution_backward``."""
    return is_call(
        node,
        edge_aten().convolution_backward.default,
        torch.ops.aten.convolution_backward.default,
    )


def is_max_pool_backward(node: object) -> bool:
    """An edge-dialect ``max_pool2d_with_indices_backward``."""
    return is_call(node, edge_aten().max_pool2d_with_indices_backward.default)


def is_avg_pool_backward(node: object) -> bool:
    """An edge-dialect ``avg_pool2d_backward``."""
    return is_call(node, edge_aten().avg_pool2d_backward.default)


def is_max_pool_with_indices(node: object) -> bool:
    """An edge-dialect forward ``max_pool2d_with_indices``."""
    return is_call(node, edge_aten().max_pool2d_with_indices.default)


def is_getitem_of(node: object, predicate) -> bool:
    return (
        is_call(node, operator.getitem)
        and isinstance(node.args[0], torch.fx.Node)
        and predicate(node.args[0])
    )


def origins(node: torch.fx.Node) -> list[str]:
    """The node's name and the names of the nodes it was traced from (``from_node``)."""
    names = [node.name]
    sources = list(node.meta.get("from_node") or [])
    while sources:
        source = sources.pop(0)
        names.append(source.name)
        sources.extend(getattr(source, "from_node", None) or [])
    return names


def filter_operand_uses(node: torch.fx.Node) -> bool:
    """Every use of ``node`` is as a convolution's weight or bias, or a
    convolution_backward's weight: a tensor in torch's layout, never an activation."""
    uses = []
    for user in node.users:
        for index, arg in enumerate(user.args):
            if arg is node:
                uses.append((user, index))
    return bool(uses) and all(
        (is_convolution(user) and index in (CONV_WEIGHT, CONV_BIAS))
        or (is_conv_bwd(user) and index == CONV_BWD_WEIGHT)
        for user, index in uses
    )
