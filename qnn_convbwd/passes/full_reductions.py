"""Loss tails QNN can take: full reductions with explicit dims, integer comparisons.

Cross-entropy with its default ``ignore_index`` leaves in a joint graph (measured
on ExecuTorch's CIFAR10Model, SM8650)::

    count = _to_dim_order_copy(sum.dim_IntList(ne(target, -100), []), float32)
    loss  = div(sum.dim_IntList(where(...), []), count)

executorch's QNN visitors refuse three of these nodes, and each split the
training graph into another delegate:

* ``sum.dim_IntList(x, [])`` (every dim, 0-d result): the visitor hands ReduceSum
  empty axes, which reduce nothing ("Out[0] has incorrect dim at index 0. Got 1
  but expected 4"). ``explicit_full_reductions`` names every dim, keeps them,
  and views the result as 0-d.
* the sum of a bool tensor is int64, which QNN has not; when every user casts the
  count to float, the bool is cast to float32 first and summed there (exact in
  the HTP's fp16 for up to 2048 elements, the bound checked), and the casts,
  then float to float, go.
* ``ne(target, ignore_index)``: executorch's I64toI32 turns an int64 constant's
  spec into float32 (``_update_meta``), so the comparison of the int32 target
  with it fails validation ("mismatching datatypes 0x32 != 0x232").
  ``narrow_int64_comparison_constants`` gives such constants an int32 spec (their
  value fits); ``int64_constants.restore_cpu_constant_dtypes`` gives a constant
  that stays on CPU its int64 back.
"""

from __future__ import annotations

import torch

from .. import integration
from .int64_constants import _stored_value

# fp16 represents every integer up to 2**11 exactly: a count summed there is exact.
EXACT_FP16_COUNT = 2**11
_COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge")


def _fake_mode(node: torch.fx.Node):
    return integration.get("detect_fake_mode")([node.meta["val"]])


def _call(graph, op, args, kwargs, like: torch.fx.Node, suffix: str) -> torch.fx.Node:
    node = graph.create_node("call_function", op, tuple(args), kwargs, name=f"{like.name}_{suffix}")
    values = torch.fx.node.map_arg(tuple(args), lambda a: a.meta["val"])
    with _fake_mode(like):
        node.meta["val"] = op(*values, **kwargs)
    if "custom" in like.meta:  # the tags other passes and rules read (an optimizer's)
        node.meta["custom"] = dict(like.meta["custom"])
    return node


def _is_float_cast(node: torch.fx.Node) -> bool:
    edge = integration.get("ops").edge
    casts = (edge.dim_order_ops._to_dim_order_copy.default, edge.aten._to_copy.default)
    return (
        node.op == "call_function"
        and node.target in casts
        and node.kwargs.get("dtype") in (torch.float32, torch.float16)
    )


def explicit_full_reductions(graph_module: torch.fx.GraphModule) -> int:
    """``sum.dim_IntList(x, [])`` -> ``view_copy(sum.dim_IntList(x, all dims, True), [])``."""
    edge, graph = integration.get("ops").edge, graph_module.graph
    changed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != edge.aten.sum.dim_IntList:
            continue
        dims = node.args[1] if len(node.args) > 1 else None
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        source = node.args[0]
        value = source.meta["val"]
        if dims or keepdim or value.dim() == 0 or node.kwargs.get("dtype") is not None:
            continue
        users = list(node.users)
        as_float = value.dtype == torch.bool
        if as_float and not (
            users and all(_is_float_cast(u) for u in users) and value.numel() <= EXACT_FP16_COUNT
        ):
            continue
        with graph.inserting_before(node):
            if as_float:
                source = _call(
                    graph,
                    edge.dim_order_ops._to_dim_order_copy.default,
                    (source,),
                    {"dtype": torch.float32},
                    node,
                    "as_float",
                )
            total = _call(
                graph,
                edge.aten.sum.dim_IntList,
                (source, list(range(value.dim())), True),
                {},
                node,
                "all_dims",
            )
            scalar = _call(graph, edge.aten.view_copy.default, (total, []), {}, node, "scalar")
        node.replace_all_uses_with(scalar)
        graph.erase_node(node)
        if as_float:
            for cast in users:
                if cast.kwargs["dtype"] == torch.float32:
                    cast.replace_all_uses_with(scalar)
                    graph.erase_node(cast)
        changed += 1
    if changed:
        graph_module.recompile()
    return changed


def narrow_int64_comparison_constants(graph_module: torch.fx.GraphModule, program) -> int:
    """int64 constants (placeholders) compared with integer tensors get an int32 spec."""
    if program is None:
        return 0
    info = torch.iinfo(torch.int32)
    changed = 0
    for node in graph_module.graph.nodes:
        value = node.meta.get("val")
        if node.op != "placeholder" or not isinstance(value, torch.Tensor):
            continue
        if value.dtype != torch.int64 or not node.users:
            continue
        stored = _stored_value(program, node)
        if not isinstance(stored, torch.Tensor) or stored.numel() == 0:
            continue
        if not (info.min <= int(stored.min()) and int(stored.max()) <= info.max):
            continue
        if not all(_compares_with_integers(user, node) for user in node.users):
            continue
        node.meta["val"] = value.to(torch.int32)
        changed += 1
    return changed


def _compares_with_integers(user: torch.fx.Node, constant: torch.fx.Node) -> bool:
    """``user`` compares ``constant`` with integer tensors (which I64toI32 makes int32)."""
    name = getattr(user.target, "__name__", "")
    if user.op != "call_function" or name.removeprefix("aten.").split(".")[0] not in _COMPARISONS:
        return False
    others = [a for a in user.args if isinstance(a, torch.fx.Node) and a is not constant]
    return bool(others) and all(o.meta["val"].dtype in (torch.int32, torch.int64) for o in others)
