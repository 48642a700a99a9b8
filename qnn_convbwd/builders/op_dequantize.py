"""QNN lowering of a dequantizing copy (``passes.quant_boundary``): QNN's Dequantize.

The copy's input is a tensor the delegate holds quantized (its producer carries
``QCOM_QUANT_ATTRS``); its output is the float tensor its readers compute with.
executorch's visitor of ``aten._to_copy`` would build a Cast; this builds
Dequantize (``float = (q - zero_point) * scale``), which QNN's HTP takes from
8- and 16-bit fixed point. Other copies go to executorch's visitor (``original``).
"""

from __future__ import annotations

import torch

from .. import integration
from ..meta import DEQUANTIZING_COPY
from . import qnn_ops

TARGET = "aten._to_copy.default"  # executorch's visitor: op_to.py


def define_dequantizing_copy(original, visitor, node: torch.fx.Node, nodes_to_wrappers):
    """QNN Dequantize for a dequantizing copy; executorch's visitor for other copies."""
    if not node.meta.get(DEQUANTIZING_COPY):
        return original()
    native = integration.get("Qnn_TensorType_t").QNN_TENSOR_TYPE_NATIVE
    source_node = node.args[0]
    source = visitor.define_tensor(
        source_node, node, visitor.get_tensor(source_node, node), native, nodes_to_wrappers
    )
    result = visitor.define_tensor(
        node, node, visitor.get_tensor(node, node), native, nodes_to_wrappers
    )
    return qnn_ops.new_op(
        f"{node.name}_dequantize",
        integration.get("OpDequantize").op_name,
        [source],
        [result],
    )
