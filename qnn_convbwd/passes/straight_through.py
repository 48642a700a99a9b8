"""The straight-through estimator of a joint graph, as quantize / dequantize pairs again.

``quantized.straight_through`` makes each activation's quantize / dequantize pair of a
pt2e-converted model one op, ``qnn_convbwd::straight_through_quantize``, so the joint
graph (``_export_forward_backward``) has gradients through the quantized part. Its
backward is already ATen in the joint graph (``x >= low and x <= high``, then a
``where`` of the gradient); its forward is the plugin's op.

``lower_fake_quantizes`` rewrites each forward op, on the ATen program before
executorch's passes, into ``dequantize_per_tensor(quantize_per_tensor(x))`` with its
parameters, which executorch's ``AnnotateQuantAttrs`` and ``FoldQDQ`` turn into
quantization metadata of ``x``'s producer, as for the model before the estimator: the
forward stays on the HTP's integer path. Where ``x`` is computed in float (a trainable
adapter), ``quant_boundary.quantize_float_producers`` later gives the quantize a float
copy of ``x`` to read, which the delegate builds as QNN's Quantize.

The backward's comparisons read ``x``: in a delegate, the tensor the delegate holds.
Where ``x``'s producer is quantized that is QNN's Dequantize of it
(``passes.quant_boundary``), which lies inside the range, so the gradient passes
everywhere there; the exact mask applies where ``x`` is float in the delegate (a
quantizing copy's input) and in a program on CPU.
"""

from __future__ import annotations

import logging

import torch

from .. import quantized  # noqa: F401  registers qnn_convbwd::straight_through_quantize

logger = logging.getLogger(__name__)


def _op():
    return torch.ops.qnn_convbwd.straight_through_quantize.default


def fake_quantize_nodes(program: torch.export.ExportedProgram) -> list[torch.fx.Node]:
    """The straight-through quantizes ``lower_fake_quantizes`` rewrites."""
    op = _op()
    return [n for n in program.graph.nodes if n.op == "call_function" and n.target == op]


def _lower(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    x, scale, zero_point, quant_min, quant_max, dtype, _low, _high = node.args
    ops = torch.ops.quantized_decomposed
    fake_mode = torch._guards.detect_fake_mode([x.meta["val"]])
    parameters = (scale, zero_point, quant_min, quant_max, dtype)
    previous = x
    for target in (ops.quantize_per_tensor.default, ops.dequantize_per_tensor.default):
        with graph.inserting_before(node):
            created = graph.call_function(target, (previous, *parameters))
        created.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        with fake_mode:
            created.meta["val"] = target(previous.meta["val"], *parameters)
        previous = created
    node.replace_all_uses_with(previous)
    graph.erase_node(node)


def lower_fake_quantizes(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``program`` (an ATen program, a joint graph) with each straight-through quantize as
    a quantize / dequantize pair, in place; returned for chaining."""
    found = fake_quantize_nodes(program)
    for node in found:
        _lower(program.graph, node)
    if found:
        program.graph_module.recompile()
        logger.info(
            "straight-through estimator: %d quantizes as quantize / dequantize pairs",
            len(found),
        )
    return program
