"""Placing per-window-offset gradients of a pool backward into grad_input (NHWC).

A pool backward sends, for every window offset ``j`` (row-major over the kernel),
a tensor ``picked_j`` of grad_output's shape to the padded input: ``picked_j[o]``
belongs at padded position ``o * s + j * d``, and what lands on one position adds
up. The max pool backward's ``picked_j`` is grad_output where the forward chose
offset ``j`` (``op_max_pool_backward``); the average pool's is grad_output divided
by its window's divisor, the same for every offset (``op_avg_pool_backward``).
Two placements of the ``picked_j``, each ending with the padding cut off
(StridedSlice):

* ``by_phases``: that position is ``(o + q) * s + r`` with phase ``r = j * d % s``
  and shift ``q = j * d // s``. The offsets of one phase are summed on the coarse
  grid (each shifted by a zero Pad of ``q``), then the ``prod(s)`` phase sums are
  interleaved per dim (Reshape / Concat / Reshape). Needs every phase to hold an
  offset; otherwise it places by ``by_window_masks``.
* ``by_window_masks``: each ``picked_j`` is upsampled by the stride with zeros,
  zero-padded by ``j * d`` into a full-resolution canvas and summed.

The geometry is ``geometry.pool.MaxPoolBackward`` (``AvgPoolBackward`` is one).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from .. import integration
from ..geometry import pool as pg
from . import qnn_ops

# (number of the offset, the offset) -> picked_j, a QNN tensor [N, *out, C]
Pick = Callable[[int, tuple], object]


def numpy_dtype(dtype: torch.dtype):
    return np.float16 if dtype == torch.float16 else np.float32


class PoolBuilder:
    """The ops of one pool backward node, and helpers to make its tensors."""

    def __init__(self, visitor, node, nodes_to_wrappers, pool: pg.MaxPoolBackward) -> None:
        self.visitor, self.node, self.n2w = visitor, node, nodes_to_wrappers
        self.pool = pool
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

    def add(self, suffix: str, left, right, shape):
        total = self.tensor(suffix, shape, self.pool.dtype)
        self.ops.append(
            qnn_ops.new_op(
                f"{self.node.name}_{suffix}_op",
                integration.get("OpElementWiseAdd").op_name,
                [left, right],
                [total],
            )
        )
        return total


def by_window_masks(b: PoolBuilder, pick: Pick, grad_input) -> list:
    """Placement by zero insertion: every offset's picked gradient at full resolution."""
    pool, name = b.pool, b.node.name
    dtype = pool.dtype
    out_shape = b.nhwc(pool.out_sizes)
    canvas = pool.canvas()
    upsampled_sizes = [o * s for o, s in zip(pool.out_sizes, pool.stride)]
    total = None
    for number, offset in enumerate(pool.offsets()):
        tag = f"w{number}"
        picked = pick(number, offset)
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
        total = placed if total is None else b.add(f"{tag}_sum", total, placed, b.nhwc(canvas))
    b.crop(total, grad_input, pool.padding)
    return b.ops


def _interleave(b: PoolBuilder, dim: int, parts: list, shape: list[int], tag: str):
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


def by_phases(b: PoolBuilder, pick: Pick, grad_input) -> list:
    """Placement by stride phases: the offsets of one phase are summed on the coarse
    grid (shifted by a Pad), then the phases are interleaved per dim. No zeros are
    inserted; a pooling whose offsets leave a phase empty uses ``by_window_masks``."""
    pool, name = b.pool, b.node.name
    if not pool.covers_every_phase():
        return by_window_masks(b, pick, grad_input)
    coarse = list(pool.coarse_sizes())
    sums: dict[tuple[int, ...], object] = {}
    for number, (offset, (phase, shift)) in enumerate(pool.phases().items()):
        picked = pick(number, offset)
        after = [m - o - q for m, o, q in zip(coarse, pool.out_sizes, shift)]
        placed = picked
        if any(shift) or any(after):
            placed = b.tensor(f"w{number}_shifted", b.nhwc(coarse), pool.dtype)
            amounts = [[0, 0], *zip(shift, after), [0, 0]]
            b.ops.append(qnn_ops.zero_pad(f"{name}_w{number}_shift", picked, placed, amounts))
        if phase in sums:
            sums[phase] = b.add(f"w{number}_sum", sums[phase], placed, b.nhwc(coarse))
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
