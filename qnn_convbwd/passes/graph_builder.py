"""Adding edge-dialect nodes to a graph module, each with its fake value and the
metadata of the node it stands in for."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import integration


class NodeBuilder:
    """Creates nodes before ``anchor`` (or ``before``) with fake values, in the anchor's
    metadata."""

    def __init__(
        self,
        graph_module: torch.fx.GraphModule,
        anchor: torch.fx.Node,
        before: torch.fx.Node | None = None,
    ) -> None:
        self.gm = graph_module
        self.anchor = anchor
        self.before = anchor if before is None else before
        self.ops = integration.get("ops").edge.aten
        self.fake_mode = integration.get("detect_fake_mode")(anchor.args[0].meta["val"])

    def constant(self, name: str, value: torch.Tensor) -> torch.fx.Node:
        attr = integration.get("get_new_attr_name_with_prefix")(f"{self.anchor.name}_{name}")(
            self.gm
        )
        self.gm.register_buffer(attr, value.contiguous())
        with self.gm.graph.inserting_before(self.before):
            node = self.gm.graph.get_attr(attr)
        node.meta["val"] = self.fake_mode.fake_tensor_converter.from_real_tensor(
            self.fake_mode, value
        )
        return node

    def call(self, target, *args) -> torch.fx.Node:
        with self.gm.graph.inserting_before(self.before):
            node = self.gm.graph.create_node("call_function", target, args)
        node.meta.update({k: v for k, v in self.anchor.meta.items() if k != "val"})
        fake_args = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
        with self.fake_mode:
            node.meta["val"] = target(*fake_args)
        return node


def rewrite_each(
    graph_module: torch.fx.GraphModule,
    target,
    rewrite: Callable[[torch.fx.GraphModule, torch.fx.Node], None],
    accept: Callable[[torch.fx.Node], bool] = lambda node: True,
) -> int:
    """Call ``rewrite(graph_module, node)`` on every call of ``target`` whose first operand
    is floating point and that ``accept`` takes; recompile if any was; return how many."""
    changed = 0
    for node in list(graph_module.graph.nodes):
        if node.op != "call_function" or node.target != target:
            continue
        if not node.args[0].meta["val"].dtype.is_floating_point or not accept(node):
            continue
        rewrite(graph_module, node)
        changed += 1
    if changed:
        graph_module.recompile()
    return changed
