"""A dequantize where a quantized tensor meets an op that computes in float.

A program quantized with pt2e (``prepare_pt2e`` / ``convert_pt2e``) only in part, such
as a quantized frozen backbone under a float head that trains, has
``quantize -> dequantize`` pairs around every quantized op, and the last dequantize
of the backbone feeds the head's first float op. executorch's ``AnnotateQuantAttrs``
writes each pair's parameters on the producer (``QCOM_QUANT_ATTRS``) and ``FoldQDQ``
removes the pair: the head's op then reads the producer's quantized tensor as if it
were float. QNN refuses such an op (measured, SM8650, ExecuTorch's CIFAR model with its
classifier left float: ``Unsupported input/output datatypes requested for the HTP Op
'Reshape'``, ``in[0]: QNN_DATATYPE_UFIXED_POINT_8``, ``out[0]: QNN_DATATYPE_FLOAT_32``),
so it stayed on CPU between two delegates.

``dequantize_float_readers`` puts the dequantize back, after ``FoldQDQ``: one
``dequantize_per_tensor`` per quantized producer whose readers compute in float, with
the producer's parameters, marked ``meta.KEPT_DEQUANTIZE`` so that executorch's
``FoldQDQ`` of the delegate's preprocess leaves it (``integration``'s FoldQDQ patch).
The delegate then converts the tensor with QNN's Dequantize and the float ops take
it, in the same delegate.
"""

from __future__ import annotations

import logging

import torch
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from .. import integration
from ..meta import KEPT_DEQUANTIZE

logger = logging.getLogger(__name__)

# The quantization parameters of QCOM_QUANT_ATTRS a per-tensor dequantize takes, in
# its argument order (after the tensor).
_PER_TENSOR_ARGS = ("scale", "zero_point", "quant_min", "quant_max", "dtype")


def _quantize_ops() -> tuple[set, set]:
    """(quantize ops, dequantize ops) of the edge dialect."""
    ops = integration.get("ops").edge.quantized_decomposed
    quantize = {
        ops.quantize_per_tensor.default,
        ops.quantize_per_tensor.tensor,
        ops.quantize_per_channel.default,
    }
    dequantize = {
        ops.dequantize_per_tensor.default,
        ops.dequantize_per_tensor.tensor,
        ops.dequantize_per_channel.default,
    }
    return quantize, dequantize


def _floating(node: torch.fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.dtype.is_floating_point


def is_kept_dequantize(node: torch.fx.Node) -> bool:
    """A dequantize this pass inserted (``FoldQDQ`` leaves it)."""
    return bool(node.meta.get(KEPT_DEQUANTIZE))


def dequantize_float_readers(graph_module: torch.fx.GraphModule) -> int:
    """Insert a dequantize between each quantized activation and its float readers;
    returns how many were inserted."""
    key = integration.get("QCOM_QUANT_ATTRS")
    quantize, dequantize = _quantize_ops()
    per_tensor = integration.get("ops").edge.quantized_decomposed
    inserted = 0
    for producer in list(graph_module.graph.nodes):
        attrs = producer.meta.get(key)
        if (
            not attrs
            or producer.op != "call_function"
            or producer.target in quantize | dequantize
            or not _floating(producer)
        ):
            continue
        readers = [
            user
            for user in producer.users
            if user.op == "call_function"
            and user.target not in quantize | dequantize
            and key not in user.meta
            and _floating(user)
        ]
        if not readers:
            continue
        if attrs.get("encoding") != per_tensor.quantize_per_tensor.default:
            logger.debug(
                "%s: quantized with %s, read as float by %s: no dequantize inserted",
                producer.name,
                attrs.get("encoding"),
                ", ".join(r.name for r in readers),
            )
            continue
        with graph_module.graph.inserting_after(producer):
            node = graph_module.graph.create_node(
                "call_function",
                per_tensor.dequantize_per_tensor.default,
                (producer, *(attrs[name] for name in _PER_TENSOR_ARGS)),
            )
        node.meta["val"] = producer.meta["val"]
        for name in ("nn_module_stack", "stack_trace"):
            if name in producer.meta:
                node.meta[name] = producer.meta[name]
        node.meta[KEPT_DEQUANTIZE] = True
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
