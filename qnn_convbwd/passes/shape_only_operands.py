"""Replace operands that are read only for their shape by a static-shape ``full``.

Three ops in training graphs read a tensor only for its shape:

* ``full_like(loss, 1)``, the seed of the backward pass;
* ``convolution_backward``'s ``input`` when only grad_input is asked for, and
  its ``weight`` when grad_input is not asked for (a grad_weight / grad_bias
  half after the split). A trainable weight is a delegate input, so a partition
  holding only the grad_weight half would otherwise declare it unread;
* ``avg_pool2d_backward``'s ``self`` (its input), always.

Left as they are, a partition that holds the op but not the producer declares
an input the QNN graph never reads, and executorch rejects the lowering
(``_check_io_binding``). A ``full`` of the same shape and dtype carries the
same information inside the partition. The input of a convolution_backward or
an avg_pool2d_backward is replaced only for nodes the support rules delegate: a
node that stays on CPU keeps its operands exactly as they were.

executorch forbids partitioners to change the graph, so this runs inside
``canonicalize.CanonicalizeConvolutionBackward``, a to_edge transform pass.
When the pass manager is given the compile specs, the decision is final
here; without them the target-dependent rules are left to the partitioner,
and the inserted ``full`` carries ``SHAPE_OF`` so the partitioner keeps it
on CPU when its consumer stays there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from .. import nodes
from ..geometry import conv as geo
from ..geometry import pool
from ..meta import SHAPE_OF

logger = logging.getLogger(__name__)


def _insert_full(
    graph: torch.fx.Graph, before: torch.fx.Node, like: torch.Tensor, value, name: str
):
    with graph.inserting_before(before):
        full = graph.create_node(
            "call_function",
            nodes.edge_aten().full.default,
            (list(like.shape), value),
            {"dtype": like.dtype},
            name=name,
        )
    full.meta["val"] = like
    return full


def _static(value) -> bool:
    return isinstance(value, torch.Tensor) and all(isinstance(d, int) for d in value.shape)


def replace_shape_only_operands(
    graph_module: torch.fx.GraphModule, delegated: Callable[[torch.fx.Node], bool]
) -> int:
    """Rewrite in place; return how many operands were replaced."""
    ops = nodes.edge_aten()
    graph = graph_module.graph
    replaced = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target == ops.full_like.default and _static(node.meta.get("val")):
            full = _insert_full(graph, node, node.meta["val"], node.args[1], f"{node.name}_full")
            full.meta[SHAPE_OF] = node.name
            node.replace_all_uses_with(full)
            graph.erase_node(node)
            replaced += 1
        elif nodes.is_conv_bwd(node):
            mask = node.args[geo.OUTPUT_MASK]
            # (operand, read only for its shape): input without grad_weight, weight
            # without grad_input.
            for index, shape_only, role in (
                (geo.INPUT, not mask[1], "input"),
                (geo.WEIGHT, not mask[0], "weight"),
            ):
                source = node.args[index]
                if not shape_only or not isinstance(source, torch.fx.Node):
                    continue
                if not _static(source.meta.get("val")) or source.target == ops.full.default:
                    continue
                if not delegated(node):
                    break
                full = _insert_full(
                    graph, node, source.meta["val"], 0.0, f"{node.name}_{role}_shape"
                )
                full.meta[SHAPE_OF] = node.name
                node.replace_input_with(source, full)
                replaced += 1
        elif nodes.is_avg_pool_backward(node):
            source = node.args[pool.A_INPUT]
            if (
                isinstance(source, torch.fx.Node)
                and _static(source.meta.get("val"))
                and source.target != ops.full.default
                and delegated(node)
            ):
                full = _insert_full(
                    graph, node, source.meta["val"], 0.0, f"{node.name}_input_shape"
                )
                full.meta[SHAPE_OF] = node.name
                node.update_arg(pool.A_INPUT, full)
                replaced += 1
    if replaced:
        graph_module.recompile()
        logger.debug("replaced %d shape-only operands by full", replaced)
    return replaced
