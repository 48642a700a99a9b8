"""A dequantizing copy where a quantized tensor meets an op that computes in float.

A program quantized with pt2e (``prepare_pt2e`` / ``convert_pt2e``) only in part, such
as a quantized frozen backbone under a float head that trains, has
``quantize -> dequantize`` pairs around every quantized op, and the last dequantize
of the backbone feeds the head's first float op. executorch's ``AnnotateQuantAttrs``
writes each pair's parameters on the producer (``QCOM_QUANT_ATTRS``) and ``FoldQDQ``
removes the pair: the head's op then reads the producer's quantized tensor as if it
were float. QNN refuses such an op (measured, SM8650, ExecuTorch's CIFAR model with
its classifier left float: ``Unsupported input/output datatypes requested for the HTP
Op 'Reshape'``, ``in[0]: QNN_DATATYPE_UFIXED_POINT_8``, ``out[0]:
QNN_DATATYPE_FLOAT_32``), so it stayed on CPU between two delegates.

``dequantize_float_readers`` gives each such producer one float copy
(``aten._to_copy`` to its float dtype, marked ``meta.DEQUANTIZING_COPY``) that its
float readers read instead, after ``FoldQDQ``. In a delegate the copy is QNN's
Dequantize of the quantized tensor (``builders/op_dequantize.py``), so the float ops
join the quantized ones' delegate. On CPU it is a copy, which is right there: the
CPU program computes the tensor in float (executorch's FoldQDQ removed its quantize),
as it would without the plugin. A dequantize node would not do: executorch's FoldQDQ
folds every activation dequantize, its visitors read through one
(``NodeVisitor.get_node``), and its CPU kernel asserts an integer input.
"""

from __future__ import annotations

import logging

import torch
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from .. import integration
from ..meta import DEQUANTIZING_COPY

logger = logging.getLogger(__name__)


def _quantize_ops() -> set:
    """The quantize and dequantize ops of the edge dialect."""
    ops = integration.get("ops").edge.quantized_decomposed
    return {
        ops.quantize_per_tensor.default,
        ops.quantize_per_tensor.tensor,
        ops.quantize_per_channel.default,
        ops.dequantize_per_tensor.default,
        ops.dequantize_per_tensor.tensor,
        ops.dequantize_per_channel.default,
    }


def _floating(node: torch.fx.Node) -> bool:
    """A floating output (the first output of a node with several: a max pool's values)."""
    value = node.meta.get("val")
    if isinstance(value, (tuple, list)) and value:
        value = value[0]
    return isinstance(value, torch.Tensor) and value.dtype.is_floating_point


def is_dequantizing_copy(node: object) -> bool:
    """A copy this pass inserted (QNN's Dequantize in a delegate)."""
    return isinstance(node, torch.fx.Node) and bool(node.meta.get(DEQUANTIZING_COPY))


def quantized_producer(node: torch.fx.Node) -> bool:
    """An op with one output that the QNN delegate holds quantized (``QCOM_QUANT_ATTRS``)."""
    value = node.meta.get("val")
    return (
        node.op == "call_function"
        and bool(node.meta.get(integration.get("QCOM_QUANT_ATTRS")))
        and node.target not in _quantize_ops()
        and isinstance(value, torch.Tensor)
        and value.dtype.is_floating_point
    )


def float_readers(producer: torch.fx.Node) -> list[torch.fx.Node]:
    """The ops that read ``producer``'s tensor and compute in float (no quantization
    metadata of their own, a floating output)."""
    key = integration.get("QCOM_QUANT_ATTRS")
    quantize_ops = _quantize_ops()
    return [
        user
        for user in producer.users
        if user.op == "call_function"
        and user.target not in quantize_ops
        and key not in user.meta
        and not is_dequantizing_copy(user)
        and _floating(user)
    ]


def dequantize_float_readers(graph_module: torch.fx.GraphModule) -> int:
    """Insert a dequantizing copy between each quantized activation and its float
    readers; returns how many were inserted."""
    copy_op = integration.get("ops").edge.aten._to_copy.default
    inserted = 0
    for producer in list(graph_module.graph.nodes):
        if not quantized_producer(producer):
            continue
        readers = float_readers(producer)
        if not readers:
            continue
        value = producer.meta["val"]
        with graph_module.graph.inserting_after(producer):
            node = graph_module.graph.create_node(
                "call_function", copy_op, (producer,), {"dtype": value.dtype}
            )
        node.meta["val"] = value
        for name in ("nn_module_stack", "stack_trace"):
            if name in producer.meta:
                node.meta[name] = producer.meta[name]
        node.meta[DEQUANTIZING_COPY] = True
        for reader in readers:
            reader.replace_input_with(producer, node)
        logger.debug(
            "%s: dequantized for its float readers %s",
            producer.name,
            ", ".join(r.name for r in readers),
        )
        inserted += 1
    if inserted:
        graph_module.recompile()
    return inserted


class DequantizeFloatReaders(PassBase):
    """to_edge transform pass running ``dequantize_float_readers`` (after FoldQDQ)."""

    def __init__(self, edge_program=None) -> None:
        super().__init__()

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        return PassResult(graph_module, dequantize_float_readers(graph_module) > 0)
