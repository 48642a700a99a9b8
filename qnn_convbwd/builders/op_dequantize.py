"""QNN lowering of a dequantizing copy (``passes.quant_boundary``): QNN's Dequantize;
and of a quantizing copy (``passes.quant_boundary``): QNN's Quantize.

The copy's input is a tensor the delegate holds quantized (its producer carries
``QCOM_QUANT_ATTRS``); its output is the float tensor its readers compute with.
executorch's visitor of ``aten._to_copy`` would build a Cast; this builds
Dequantize (``float = (q - zero_point) * scale``), which QNN's HTP takes from
8- and 16-bit fixed point. A quantizing copy is the other way round: its input is a
float tensor (a trainable adapter's output) and executorch's FoldQDQ gave the copy
the quantization of the quantize it read; its visitor builds Quantize, where
executorch's would build a Cast of the values. Other copies go to executorch's visitor
(``original``).
"""

from __future__ import annotations

import torch

from .. import integration
from ..meta import DEQUANTIZING_COPY, QUANTIZING_COPY
from . import qnn_ops

TARGET = "aten._to_copy.default"  # executorch's visitor: op_to.py


def is_quantizing_copy(node: torch.fx.Node) -> bool:
    """A copy ``passes.quant_boundary`` put before the quantize of a float tensor."""
    return bool(node.meta.get(QUANTIZING_COPY))


def define_dequantizing_copy(original, visitor, node: torch.fx.Node, nodes_to_wrappers):
    """QNN Dequantize for a dequantizing copy, Quantize for a quantizing copy that holds
    its quantization; executorch's visitor for other copies."""
    quantizing = is_quantizing_copy(node) and bool(
        node.meta.get(integration.get("QCOM_QUANT_ATTRS"))
    )
    if not node.meta.get(DEQUANTIZING_COPY) and not quantizing:
        return original()
    native = integration.get("Qnn_TensorType_t").QNN_TENSOR_TYPE_NATIVE
    source_node = node.args[0]
    source = visitor.define_tensor(
        source_node, node, visitor.get_tensor(source_node, node), native, nodes_to_wrappers
    )
    result = visitor.define_tensor(
        node, node, visitor.get_tensor(node, node), native, nodes_to_wrappers
    )
    kind = "quantize" if quantizing else "dequantize"
    op = integration.get("OpQuantize" if quantizing else "OpDequantize")
    return qnn_ops.new_op(f"{node.name}_{kind}", op.op_name, [source], [result])
