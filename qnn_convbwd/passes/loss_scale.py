"""Static loss scaling of a joint forward-backward graph (``options.loss_scale``).

The backward of ``torch.export.experimental._export_forward_backward`` starts
from a seed ``full_like(loss, 1)``. ``ScaleLoss`` makes the seed ``S``, so every
gradient the HTP computes in fp16 is ``S`` times larger (above fp16's
underflow), and multiplies each gradient output by ``1 / S`` where it leaves the
graph. Those multiplications carry ``UNSCALE`` in their metadata and the
partitioner keeps them on CPU (``partition.judge.loss_unscale``): they run in fp32 on
the delegate's fp32 outputs, exact for a power-of-two ``S``.

The loss output itself is not scaled (the seed is not an ancestor of it).
"""

from __future__ import annotations

import logging

import torch

from .. import integration
from ..meta import UNSCALE
from .gated import OptionGatedPass

logger = logging.getLogger(__name__)


class LossScaleError(ValueError):
    """The graph's backward seed cannot be found unambiguously."""


def _output_kinds(edge_program) -> list[str]:
    return [spec.kind.name for spec in edge_program.graph_signature.output_specs]


def _ancestors(node: torch.fx.Node) -> set[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        for arg in n.all_input_nodes:
            if arg not in seen:
                seen.add(arg)
                stack.append(arg)
    return seen


def find_seed(graph: torch.fx.Graph, loss: torch.fx.Node) -> torch.fx.Node:
    """The ``full_like(loss, 1)`` (or ``full(loss.shape, 1)``) the backward starts from."""
    ops = integration.get("ops").edge.aten
    loss_shape = list(loss.meta["val"].shape)
    upstream = _ancestors(loss)
    candidates = []
    for node in graph.nodes:
        if node.op != "call_function" or node in upstream:
            continue
        if node.target == ops.full_like.default and node.args[0] is loss:
            fill = node.args[1]
        elif node.target == ops.full.default and list(node.args[0]) == loss_shape:
            fill = node.args[1]
        else:
            continue
        if fill == 1:
            candidates.append(node)
    if len(candidates) != 1:
        names = [n.name for n in candidates]
        raise LossScaleError(f"loss_scale: expected one backward seed of value 1, found {names}")
    return candidates[0]


def scale_loss(graph_module: torch.fx.GraphModule, edge_program, scale: float) -> int:
    """Seed the backward with ``scale``; unscale each gradient output. Returns how many."""
    kinds = _output_kinds(edge_program)
    if "LOSS_OUTPUT" not in kinds:
        return 0
    output = graph_module.graph.output_node()
    results = list(output.args[0])
    seed = find_seed(graph_module.graph, results[kinds.index("LOSS_OUTPUT")])
    seed.args = (seed.args[0], scale, *seed.args[2:])
    mul = integration.get("ops").edge.aten.mul.Scalar
    unscaled = 0
    for i, kind in enumerate(kinds):
        if kind != "GRADIENT_TO_PARAMETER":
            continue
        grad = results[i]
        with graph_module.graph.inserting_before(output):
            node = graph_module.graph.create_node("call_function", mul, (grad, 1.0 / scale))
        node.meta.update({k: v for k, v in grad.meta.items() if k != "val"})
        node.meta["val"] = grad.meta["val"]
        node.meta[UNSCALE] = scale
        results[i] = node
        unscaled += 1
    output.args = (tuple(results),)
    graph_module.recompile()
    logger.info("loss_scale %g: seed %s, %d gradients unscaled on CPU", scale, seed.name, unscaled)
    return unscaled


class ScaleLoss(OptionGatedPass):
    """to_edge transform pass running ``scale_loss`` with ``options.current.loss_scale``."""

    def enabled(self, options) -> bool:
        return options.loss_scale != 1.0 and self.edge_program is not None

    def rewrite(self, graph_module: torch.fx.GraphModule) -> int:
        from .. import options

        return scale_loss(graph_module, self.edge_program, options.current.loss_scale)
