"""QNN lowering of ``aten.avg_pool2d_backward`` (NHWC activations).

Torch spreads each grad_output element, divided by its window's divisor, over the
input elements of its window; windows that overlap add up. The divisor depends only
on the output position (``geometry.pool.AvgPoolBackward.divisors``: the window clipped
to the padded input with ``count_include_pad``, to the input without it, or
``divisor_override``)::

    scaled   = ElementWiseMultiply(grad_output, 1 / divisor)  # static [1, *out, 1], or
                                                               # [1, 1, 1, 1] when uniform
    picked_j = scaled                                          # every window offset j

then ``pool_placement.by_phases`` puts ``picked_j[o]`` at padded position ``o * s + j``
and cuts the padding off. A divisor of 1 everywhere needs no multiply. The input is
read only for its shape, so the transform pass gives a delegated node a static
``full`` there. The visitor does not decide support (``partition.avg_pool.decide``
does).
"""

from __future__ import annotations

import numpy as np
import torch

from .. import integration
from ..geometry import pool as pg
from . import qnn_ops
from .pool_placement import PoolBuilder, by_phases, numpy_dtype

NodeVisitor = integration.get("NodeVisitor")

TARGET = "aten.avg_pool2d_backward.default"


def reciprocal_table(pool: pg.AvgPoolBackward) -> np.ndarray:
    """``1 / divisor`` as the static ``[1, *out, 1]`` grad_output is multiplied by, or
    ``[1, 1, 1, 1]`` when every window has the same divisor (fp32 values)."""
    divisors = np.asarray(pool.divisors(), dtype=np.float64)
    if np.all(divisors == divisors.flat[0]):
        divisors = np.full((1, 1), divisors.flat[0])
    return (1.0 / divisors).astype(np.float32)[None, :, :, None]


class AvgPoolBackwardVisitor(NodeVisitor):
    target = [TARGET]

    def define_node(self, node: torch.fx.Node, nodes_to_wrappers):
        pool = pg.parse_avg(node)
        native = integration.get("Qnn_TensorType_t").QNN_TENSOR_TYPE_NATIVE
        source = self.get_node(node.args[pg.A_GRAD_OUTPUT])
        grad_output = self.define_tensor(
            source, node, self.get_tensor(source, node), native, nodes_to_wrappers
        )
        grad_input = self.define_tensor(
            node, node, self.get_tensor(node, node), native, nodes_to_wrappers
        )
        b = PoolBuilder(self, node, nodes_to_wrappers, pool)
        table = reciprocal_table(pool)
        scaled = grad_output
        if not np.all(table == 1.0):
            scale = b.static("reciprocal", table.astype(numpy_dtype(pool.dtype)), pool.dtype)
            scaled = b.tensor("scaled", b.nhwc(pool.out_sizes), pool.dtype)
            b.ops.append(
                qnn_ops.new_op(
                    f"{node.name}_scale",
                    integration.get("OpElementWiseMultiply").op_name,
                    [grad_output, scale],
                    [scaled],
                )
            )
        return by_phases(b, lambda number, offset: scaled, grad_input)
