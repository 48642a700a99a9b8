"""Tuple outputs with ``None`` entries in executorch's I64toI32 pass.

convolution_backward returns a 3-tuple whose unrequested entries are ``None``.
I64toI32 records and later restores the dtype of every graph output, reading
``.dtype`` of each tuple entry. These replacements skip ``None`` entries and
hand single-tensor outputs to the original code unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import integration
from ..meta import TUPLE_DTYPES as _TUPLE_KEY


def _is_graph_output(node: torch.fx.Node) -> bool:
    for user in node.users:
        if user.op == "output":
            return True
        if getattr(user.target, "__name__", "") == "getitem" and _is_graph_output(user):
            return True
    return False


def _dtypes(value) -> list:
    return [None if v is None else v.dtype for v in value]


def record_output_dtypes(pass_, graph_module: torch.fx.GraphModule) -> None:
    key = integration.get("QCOM_ORIG_DTYPE")
    for node in graph_module.graph.nodes:
        if not _is_graph_output(node):
            continue
        value = node.meta["val"]
        if isinstance(value, (tuple, list)):
            node.meta[_TUPLE_KEY] = _dtypes(value)
        else:
            node.meta[key] = value.dtype


def preserve_output_dtypes(
    original: Callable[[torch.fx.GraphModule], None], pass_, graph_module: torch.fx.GraphModule
) -> None:
    for node in graph_module.graph.nodes:
        recorded = node.meta.pop(_TUPLE_KEY, None)
        if recorded is None:
            continue
        now = _dtypes(node.meta["val"])
        # A None recorded is an entry no pass had computed yet (executorch's
        # RecomposePadMaxPool2d leaves a pool's indices None until I64toI32 retraces).
        changed = [i for i, (a, b) in enumerate(zip(recorded, now)) if a is not None and a != b]
        if changed:
            raise AssertionError(
                f"{node.name}: I64toI32 changed the dtype of tuple outputs {changed} "
                f"({recorded} -> {now}); casting tuple outputs back is not supported"
            )
    original(graph_module)
