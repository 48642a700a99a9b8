"""QNN lowering of ``aten.max_pool2d_with_indices_backward`` (NHWC activations).

Torch routes each grad_output element to the one input element the forward
chose, the flat index in ``indices``; windows that overlap add up. The visitor
reads the indices, so ties and NaNs go exactly where torch's forward sent them.
Per window offset ``j`` (``kernel`` offsets, row-major)::

    table_j    = flat index of the input element offset j of window o reads (-1 in padding)
    mask_j     = ElementWiseEqual(indices, table_j)          # table_j static [1, *out, 1]
    picked_j   = ElementWiseSelect(mask_j, grad_output, 0)

``picked_j[o]`` belongs at padded position ``o * s + j * d``. Placement
(``FORMULATION``):

* ``phases`` (default): that position is ``(o + q) * s + r`` with phase
  ``r = j * d % s`` and shift ``q = j * d // s``. The offsets of one phase are
  summed on the coarse grid (each shifted by a zero Pad of ``q``), then the
  ``prod(s)`` phase sums are interleaved per dim (Reshape / Concat / Reshape)
  and the padding is cut off (StridedSlice). Used when every phase has an
  offset (all of torchvision's pools); otherwise ``window_masks``.
* ``window_masks``: each ``picked_j`` is upsampled by the stride with zeros,
  zero-padded by ``j * d`` into a full-resolution canvas and summed.
* ``scatter_add``: one ScatterElements with reduction ADD into zeros, kept for
  measuring: QAIRT 2.51's HTP rejects it in floating point (docs/max_pool.md).

The indices count in the plane recorded by the transform pass
(``geometry.pool.IndexPlane`` under ``INDEX_PLANE``), which may be the padded
plane of executorch's RecomposePadMaxPool2d. The visitor does not decide
support (``partition.max_pool.decide`` does).
"""

from __future__ import annotations

import numpy as np
import torch

from .. import integration
from ..geometry import pool as pg
from ..meta import INDEX_PLANE
from . import qnn_ops
from .pool_placement import PoolBuilder, by_phases, by_window_masks, numpy_dtype

NodeVisitor = integration.get("NodeVisitor")

TARGET = "aten.max_pool2d_with_indices_backward.default"


def window_table(pool: pg.MaxPoolBackward, plane: pg.IndexPlane, offset) -> np.ndarray:
    """int32 ``[1, *out, 1]``: per output position, the flat index ``offset`` reads, or -1."""
    table = np.full((1, *pool.out_sizes, 1), -1, dtype=np.int32)
    for out_position in np.ndindex(*pool.out_sizes):
        element = pool.window_element(out_position, offset)
        if element is not None:
            table[(0, *out_position, 0)] = plane.flat(element)
    return table


class _Builder(PoolBuilder):
    def __init__(self, visitor, node, nodes_to_wrappers, pool, plane) -> None:
        super().__init__(visitor, node, nodes_to_wrappers, pool)
        self.plane = plane


def _picked(b: _Builder, number: int, offset, grad_output, indices):
    """grad_output where offset ``offset`` of the window is the one the forward chose, else 0."""
    pool, name, tag = b.pool, b.node.name, f"w{number}"
    out_shape = b.nhwc(pool.out_sizes)
    table = b.static(f"{tag}_table", window_table(pool, b.plane, offset), torch.int32)
    mask = b.tensor(f"{tag}_mask", out_shape, torch.bool)
    b.ops.append(
        qnn_ops.new_op(
            f"{name}_{tag}_eq",
            integration.get("OpElementWiseEqual").op_name,
            [indices, table],
            [mask],
        )
    )
    zero = b.static("zero", np.zeros((1, 1, 1, 1), dtype=numpy_dtype(pool.dtype)), pool.dtype)
    picked = b.tensor(f"{tag}_picked", out_shape, pool.dtype)
    b.ops.append(
        qnn_ops.new_op(
            f"{name}_{tag}_select",
            integration.get("OpElementWiseSelect").op_name,
            [mask, grad_output, zero],
            [picked],
        )
    )
    return picked


def _window_masks(b: _Builder, grad_output, indices, grad_input) -> list:
    """Placement by zero insertion (``pool_placement.by_window_masks``)."""

    def pick(number, offset):
        return _picked(b, number, offset, grad_output, indices)

    return by_window_masks(b, pick, grad_input)


def _phases(b: _Builder, grad_output, indices, grad_input) -> list:
    """Placement by stride phases (``pool_placement.by_phases``)."""

    def pick(number, offset):
        return _picked(b, number, offset, grad_output, indices)

    return by_phases(b, pick, grad_input)


def _scatter_add(b: _Builder, grad_output, indices, grad_input) -> list:
    pool, name = b.pool, b.node.name
    dtype = pool.dtype
    plane_size = int(np.prod(b.plane.sizes))
    out_size = int(np.prod(pool.out_sizes))
    flat_indices = b.tensor("flat_indices", [b.batch, out_size, b.channels], torch.int32)
    b.ops.append(qnn_ops.reshape(f"{name}_flat_indices", indices, flat_indices))
    flat_grad = b.tensor("flat_grad", [b.batch, out_size, b.channels], dtype)
    b.ops.append(qnn_ops.reshape(f"{name}_flat_grad", grad_output, flat_grad))
    zeros = b.static(
        "zeros", np.zeros((b.batch, plane_size, b.channels), dtype=numpy_dtype(dtype)), dtype
    )
    scattered = b.tensor("scattered", [b.batch, plane_size, b.channels], dtype)
    names = integration.get("OpScatterElements")
    scatter = qnn_ops.new_op(
        f"{name}_scatter", names.op_name, [zeros, flat_indices, flat_grad], [scattered]
    )
    qnn_ops.uint32_scalar(scatter, names.param_axis, 1)
    qnn_ops.uint32_scalar(scatter, names.param_reduction, names.Reduction.ADD)
    b.ops.append(scatter)
    planes = b.tensor("planes", b.nhwc(b.plane.sizes), dtype)
    b.ops.append(qnn_ops.reshape(f"{name}_planes", scattered, planes))
    b.crop(planes, grad_input, b.plane.offset)
    return b.ops


FORMULATIONS = {"phases": _phases, "window_masks": _window_masks, "scatter_add": _scatter_add}
FORMULATION = "phases"


class MaxPoolBackwardVisitor(NodeVisitor):
    target = [TARGET]

    def define_node(self, node: torch.fx.Node, nodes_to_wrappers):
        pool = pg.parse(node)
        plane = node.meta.get(INDEX_PLANE)
        if plane is None:
            raise pg.PoolArgumentError(
                f"{node.name}: no {INDEX_PLANE} (the plugin's transform pass did not prepare it)"
            )
        native = integration.get("Qnn_TensorType_t").QNN_TENSOR_TYPE_NATIVE

        def operand(index: int):
            source = self.get_node(node.args[index])
            value = self.get_tensor(source, node)  # NHWC after the layout transform
            if index == pg.INDICES and value.dtype == torch.int64:
                # Indices of a forward pool delegated with them: the forward's visitor
                # (op_max_pool_with_indices) makes them int32, under the same name.
                value = value.to(torch.int32)
            return self.define_tensor(source, node, value, native, nodes_to_wrappers)

        grad_output, indices = operand(pg.GRAD_OUTPUT), operand(pg.INDICES)
        grad_input = self.define_tensor(
            node, node, self.get_tensor(node, node), native, nodes_to_wrappers
        )
        builder = _Builder(self, node, nodes_to_wrappers, pool, plane)
        return FORMULATIONS[FORMULATION](builder, grad_output, indices, grad_input)
