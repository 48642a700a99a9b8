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


def _numpy(dtype: torch.dtype):
    return np.float16 if dtype == torch.float16 else np.float32


class _Builder:
    def __init__(self, visitor, node, nodes_to_wrappers, pool, plane) -> None:
        self.visitor, self.node, self.n2w = visitor, node, nodes_to_wrappers
        self.pool, self.plane = pool, plane
        self.ops: list = []
        self.batch, self.channels = int(pool.input_shape[0]), int(pool.input_shape[1])

    def tensor(self, suffix: str, shape, dtype):
        name = f"{self.node.name}_{suffix}"
        return qnn_ops.native_tensor(self.visitor, name, shape, dtype, self.n2w)

    def static(self, suffix: str, value: np.ndarray, dtype):
        return qnn_ops.static_tensor(
            f"{self.node.name}_{suffix}", value, value.shape, dtype, self.n2w
        )

    def nhwc(self, sizes) -> list[int]:
        return [self.batch, *sizes, self.channels]

    def crop(self, source, grad_input, offset) -> None:
        ranges = [[0, self.batch, 1]]
        ranges += [[o, o + i, 1] for o, i in zip(offset, self.pool.in_sizes)]
        ranges.append([0, self.channels, 1])
        self.ops.append(qnn_ops.strided_slice(f"{self.node.name}_crop", source, grad_input, ranges))


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
    zero = b.static("zero", np.zeros((1, 1, 1, 1), dtype=_numpy(pool.dtype)), pool.dtype)
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


def _add(b: _Builder, suffix: str, left, right, shape):
    total = b.tensor(suffix, shape, b.pool.dtype)
    b.ops.append(
        qnn_ops.new_op(
            f"{b.node.name}_{suffix}_op",
            integration.get("OpElementWiseAdd").op_name,
            [left, right],
            [total],
        )
    )
    return total


def _window_masks(b: _Builder, grad_output, indices, grad_input) -> list:
    """Placement by zero insertion: every offset's picked gradient at full resolution."""
    pool, name = b.pool, b.node.name
    dtype = pool.dtype
    out_shape = b.nhwc(pool.out_sizes)
    canvas = pool.canvas()
    upsampled_sizes = [o * s for o, s in zip(pool.out_sizes, pool.stride)]
    total = None
    for number, offset in enumerate(pool.offsets()):
        tag = f"w{number}"
        picked = _picked(b, number, offset, grad_output, indices)
        upsampled = picked
        if any(s > 1 for s in pool.stride):
            zi_ops, upsampled, _ = qnn_ops.zero_insert(
                b.visitor, f"{name}_{tag}_up", picked, out_shape, pool.stride, dtype, b.n2w
            )
            b.ops += zi_ops
        before = [j * d for j, d in zip(offset, pool.dilation)]
        after = [c - u - x for c, u, x in zip(canvas, upsampled_sizes, before)]
        placed = b.tensor(f"{tag}_placed", b.nhwc(canvas), dtype)
        amounts = [[0, 0], *zip(before, after), [0, 0]]
        b.ops.append(qnn_ops.zero_pad(f"{name}_{tag}_place", upsampled, placed, amounts))
        total = placed if total is None else _add(b, f"{tag}_sum", total, placed, b.nhwc(canvas))
    b.crop(total, grad_input, pool.padding)
    return b.ops


def _interleave(b: _Builder, dim: int, parts: list, shape: list[int], tag: str):
    """``parts[r]`` holds every ``s``-th element of spatial dim ``dim`` from ``r`` on:
    one tensor with that dim ``s`` times as long (Reshape / Concat / Reshape, rank 3)."""
    axis = 1 + dim
    lead = int(np.prod(shape[: axis + 1]))
    trail = int(np.prod(shape[axis + 1 :]))
    dtype = b.pool.dtype
    views = []
    for r, part in enumerate(parts):
        view = b.tensor(f"{tag}_v{r}", [lead, 1, trail], dtype)
        b.ops.append(qnn_ops.reshape(f"{b.node.name}_{tag}_v{r}_op", part, view))
        views.append(view)
    stacked = b.tensor(f"{tag}_cat", [lead, len(parts), trail], dtype)
    names = integration.get("OpConcat")
    concat = qnn_ops.new_op(f"{b.node.name}_{tag}_cat_op", names.op_name, views, [stacked])
    qnn_ops.uint32_scalar(concat, names.param_axis, 1)
    b.ops.append(concat)
    longer = list(shape)
    longer[axis] *= len(parts)
    merged = b.tensor(f"{tag}_merged", longer, dtype)
    b.ops.append(qnn_ops.reshape(f"{b.node.name}_{tag}_op", stacked, merged))
    return merged, longer


def _phases(b: _Builder, grad_output, indices, grad_input) -> list:
    """Placement by stride phases: the offsets of one phase are summed on the coarse
    grid (shifted by a Pad), then the phases are interleaved per dim. No zeros are
    inserted; a pooling whose offsets leave a phase empty uses ``_window_masks``."""
    pool, name = b.pool, b.node.name
    if not pool.covers_every_phase():
        return _window_masks(b, grad_output, indices, grad_input)
    coarse = list(pool.coarse_sizes())
    sums: dict[tuple[int, ...], object] = {}
    for number, (offset, (phase, shift)) in enumerate(pool.phases().items()):
        picked = _picked(b, number, offset, grad_output, indices)
        after = [m - o - q for m, o, q in zip(coarse, pool.out_sizes, shift)]
        placed = picked
        if any(shift) or any(after):
            placed = b.tensor(f"w{number}_shifted", b.nhwc(coarse), pool.dtype)
            amounts = [[0, 0], *zip(shift, after), [0, 0]]
            b.ops.append(qnn_ops.zero_pad(f"{name}_w{number}_shift", picked, placed, amounts))
        if phase in sums:
            sums[phase] = _add(b, f"w{number}_sum", sums[phase], placed, b.nhwc(coarse))
        else:
            sums[phase] = placed
    shape = b.nhwc(coarse)
    for dim, stride in enumerate(pool.stride):
        if stride == 1:
            continue
        merged: dict[tuple[int, ...], object] = {}
        longer = shape
        for rest in sorted({k[:dim] + (0,) + k[dim + 1 :] for k in sums}):
            parts = [sums[rest[:dim] + (r,) + rest[dim + 1 :]] for r in range(stride)]
            tag = f"d{dim}_" + "_".join(map(str, rest))
            merged[rest], longer = _interleave(b, dim, parts, shape, tag)
        sums, shape = merged, longer
    (total,) = sums.values()
    b.crop(total, grad_input, pool.padding)
    return b.ops


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
        "zeros", np.zeros((b.batch, plane_size, b.channels), dtype=_numpy(dtype)), dtype
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
