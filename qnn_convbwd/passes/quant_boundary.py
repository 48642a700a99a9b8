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
import operator

import torch
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from .. import integration, signature
from ..meta import DEQUANTIZING_COPY, QUANTIZING_COPY

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
    """A floating output (the first output present of a node with several: a max pool's
    values, a ``convolution_backward``'s grad_input or, when that is not computed, its
    grad_weight), or a boolean one (a comparison, which reads its operands as float)."""
    value = node.meta.get("val")
    if isinstance(value, (tuple, list)):
        value = next((v for v in value if v is not None), None)
    return isinstance(value, torch.Tensor) and (
        value.dtype.is_floating_point or value.dtype == torch.bool
    )


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


# --- the other way: a tensor computed in float, quantized for quantized readers ---------


def _dequantize_ops() -> set:
    ops = integration.get("ops").edge.quantized_decomposed
    return {
        ops.dequantize_per_tensor.default,
        ops.dequantize_per_tensor.tensor,
        ops.dequantize_per_channel.default,
    }


def _float_operands(node: torch.fx.Node) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), found.append)
    return [
        n
        for n in found
        if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dtype.is_floating_point
    ]


def computed_in_float(node: torch.fx.Node, edge_program=None) -> bool:
    """Whether ``node`` computes in float: an op reading a float tensor that no dequantize
    produced, the output of another op or a trainable parameter (an adapter's weight).
    A graph input or a frozen parameter read directly is not a sign (executorch
    quantizes a delegate's quantized inputs itself, and an op reads some operands only
    for their shape), nor a node that is no op."""
    if node.op != "call_function":
        return False
    if node.target == operator.getitem:
        return computed_in_float(node.args[0], edge_program)
    dequantizes = _dequantize_ops()
    for operand in _float_operands(node):
        if operand.op == "placeholder":
            if edge_program is not None and signature.is_trainable_parameter(operand, edge_program):
                return True
        elif operand.target not in dequantizes:
            return True
    return False


def quantize_float_producers(graph_module: torch.fx.GraphModule, edge_program=None) -> int:
    """Insert a quantizing copy between each quantize and the tensor it reads when that
    tensor is computed in float; returns how many were inserted. Runs before
    executorch's AnnotateQuantAttrs, which then writes the quantization on the copy, not
    on the float op (whose visitor would build it as a quantized op)."""
    ops = integration.get("ops").edge
    quantizes = {
        ops.quantized_decomposed.quantize_per_tensor.default,
        ops.quantized_decomposed.quantize_per_tensor.tensor,
    }
    inserted = 0
    for quantize in list(graph_module.graph.nodes):
        if quantize.op != "call_function" or quantize.target not in quantizes:
            continue
        source = quantize.args[0]
        if not isinstance(source, torch.fx.Node) or not computed_in_float(source, edge_program):
            continue
        value = source.meta["val"]
        with graph_module.graph.inserting_before(quantize):
            copy = graph_module.graph.create_node(
                "call_function", ops.aten._to_copy.default, (source,), {"dtype": value.dtype}
            )
        copy.meta["val"] = value
        for name in ("nn_module_stack", "stack_trace"):
            if name in source.meta:
                copy.meta[name] = source.meta[name]
        copy.meta[QUANTIZING_COPY] = True
        quantize.replace_input_with(source, copy)
        logger.debug("%s: quantized through a copy for %s", source.name, quantize.name)
        inserted += 1
    if inserted:
        graph_module.recompile()
    return inserted


class QuantizeFloatProducers(PassBase):
    """to_edge transform pass running ``quantize_float_producers`` (before
    AnnotateQuantAttrs)."""

    def __init__(self, edge_program=None) -> None:
        super().__init__()
        self.edge_program = edge_program

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        changed = quantize_float_producers(graph_module, self.edge_program)
        return PassResult(graph_module, changed > 0)
