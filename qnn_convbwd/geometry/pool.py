"""Arguments of ``aten.max_pool2d_with_indices_backward`` and where its indices point.

Schema: https://github.com/pytorch/pytorch/blob/main/aten/src/ATen/native/native_functions.yaml
(``max_pool2d_with_indices_backward``). Shapes are NCHW: grad_output and
indices ``[N, C, *out]``, input ``[N, C, *in]``. Each index is the flat position
``h * W + w`` of the element the forward chose, within the plane of its (n, c).

The *index plane* is the plane those flat positions count in. It is the input's
plane, except after executorch's ``RecomposePadMaxPool2d``: that pass rewrites
a padded forward ``max_pool2d_with_indices`` into ``constant_pad_nd(-inf)`` and
an unpadded pool, so the forward's indices count in the *padded* plane while the
backward node still names the unpadded input and its padding. ``IndexPlane``
records the plane's size and the offset of input element 0 inside it.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections.abc import Iterator, Sequence

import torch

# Argument positions in the schema.
GRAD_OUTPUT, INPUT, KERNEL, STRIDE, PADDING, DILATION, CEIL_MODE, INDICES = range(8)
SPATIAL_DIMS = 2


class PoolArgumentError(ValueError):
    """The node's arguments do not describe a max pool backward we understand."""


def _per_dim(name: str, values: Sequence[int], default: Sequence[int]) -> tuple[int, ...]:
    """One rule for every per-dim argument: empty takes ``default``, length 1 broadcasts."""
    values = tuple(int(v) for v in values) or tuple(default)
    if len(values) == 1:
        values = values * SPATIAL_DIMS
    if len(values) != SPATIAL_DIMS:
        raise PoolArgumentError(f"{name} has {len(values)} entries for {SPATIAL_DIMS} dims")
    return values


@dataclasses.dataclass(frozen=True)
class IndexPlane:
    """Flat indices count positions in a plane of ``sizes``; input element 0 sits at ``offset``."""

    sizes: tuple[int, ...]
    offset: tuple[int, ...]

    def flat(self, position: Sequence[int]) -> int:
        """Flat index of an input position (input coordinates)."""
        flat = 0
        for p, size, off in zip(position, self.sizes, self.offset):
            flat = flat * size + p + off
        return flat

    @property
    def is_input(self) -> bool:
        return not any(self.offset)


@dataclasses.dataclass(frozen=True)
class MaxPoolBackward:
    grad_output_shape: tuple[int, ...]
    input_shape: tuple[int, ...]
    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    ceil_mode: bool
    dtype: torch.dtype

    @property
    def in_sizes(self) -> tuple[int, ...]:
        return tuple(self.input_shape[2:])

    @property
    def out_sizes(self) -> tuple[int, ...]:
        return tuple(self.grad_output_shape[2:])

    def per_dim(self) -> list[tuple[int, int, int, int, int, int]]:
        """Per spatial dim: (input size, grad_output size, kernel, stride, padding, dilation)."""
        return list(
            zip(
                self.in_sizes,
                self.out_sizes,
                self.kernel,
                self.stride,
                self.padding,
                self.dilation,
            )
        )

    def offsets(self) -> Iterator[tuple[int, ...]]:
        """Window offsets in the forward's scan order (row-major over the kernel)."""
        return itertools.product(*(range(k) for k in self.kernel))

    def canvas(self) -> tuple[int, ...]:
        """Per dim, the padded extent that holds every window element, ceil_mode included.

        Output ``o`` reads padded positions ``o * s + j * d`` for kernel offset ``j``.
        """
        return tuple(max(i + 2 * p, o * s + (k - 1) * d) for i, o, k, s, p, d in self.per_dim())

    def phases(self) -> dict[tuple[int, ...], tuple[tuple[int, ...], tuple[int, ...]]]:
        """Per window offset ``j``: its stride phase ``j * d % s`` and coarse shift ``j * d // s``.

        Output ``o`` with offset ``j`` reads padded position ``o * s + j * d``
        = ``(o + shift) * s + phase``: every offset of one phase lands on the same
        sub-grid of the padded input, shifted by whole grid steps.
        """
        return {
            offset: (
                tuple(j * d % s for j, s, d in zip(offset, self.stride, self.dilation)),
                tuple(j * d // s for j, s, d in zip(offset, self.stride, self.dilation)),
            )
            for offset in self.offsets()
        }

    def coarse_sizes(self) -> tuple[int, ...]:
        """Per dim, the sub-grid length that holds every shifted output and the input."""
        shifts = [shift for _, shift in self.phases().values()]
        return tuple(
            max(o + max(q[dim] for q in shifts), -(-(i + p) // s))
            for dim, (i, o, _, s, p, _) in enumerate(self.per_dim())
        )

    def covers_every_phase(self) -> bool:
        phases = {phase for phase, _ in self.phases().values()}
        count = 1
        for s in self.stride:
            count *= s
        return len(phases) == count

    def window_element(self, out_position: Sequence[int], offset: Sequence[int]) -> tuple | None:
        """Input position read by ``offset`` of the window at ``out_position``; None in padding."""
        position = []
        for o, j, (i, _, _, s, p, d) in zip(out_position, offset, self.per_dim()):
            x = o * s + j * d - p
            if not 0 <= x < i:
                return None
            position.append(x)
        return tuple(position)


def _static(shape) -> tuple[int, ...]:
    if any(not isinstance(d, int) for d in shape):
        raise PoolArgumentError(f"dynamic shape {list(shape)}")
    return tuple(shape)


def parse(node: torch.fx.Node) -> MaxPoolBackward:
    args = list(node.args)
    if len(args) != INDICES + 1:
        raise PoolArgumentError(f"{len(args)} arguments, the schema has {INDICES + 1}")
    grad_output = args[GRAD_OUTPUT].meta["val"]
    source = args[INPUT].meta["val"]
    if grad_output.dim() != SPATIAL_DIMS + 2:
        raise PoolArgumentError(f"grad_output of rank {grad_output.dim()}, expected 4 (NCHW)")
    kernel = _per_dim("kernel_size", args[KERNEL], ())
    return MaxPoolBackward(
        grad_output_shape=_static(grad_output.shape),
        input_shape=_static(source.shape),
        kernel=kernel,
        stride=_per_dim("stride", args[STRIDE], kernel),
        padding=_per_dim("padding", args[PADDING], (0,)),
        dilation=_per_dim("dilation", args[DILATION], (1,)),
        ceil_mode=bool(args[CEIL_MODE]),
        dtype=grad_output.dtype,
    )


# Argument positions of the forward ``max_pool2d_with_indices(self, kernel_size, stride=[],
# padding=0, dilation=1, ceil_mode=False)`` (same schema file).
F_INPUT, F_KERNEL, F_STRIDE, F_PADDING, F_DILATION, F_CEIL_MODE = range(6)
VALUES, INDICES_OUTPUT = 0, 1  # getitem positions of the forward's outputs


def parse_forward(node: torch.fx.Node) -> MaxPoolBackward:
    """The window geometry of a forward ``max_pool2d_with_indices``: the same
    ``MaxPoolBackward`` its backward would be (``grad_output_shape`` = the values')."""
    args = list(node.args)
    if not 2 <= len(args) <= F_CEIL_MODE + 1:
        raise PoolArgumentError(f"{len(args)} arguments, the schema has {F_CEIL_MODE + 1}")
    source = args[F_INPUT].meta["val"]
    if source.dim() != SPATIAL_DIMS + 2:
        raise PoolArgumentError(f"input of rank {source.dim()}, expected 4 (NCHW)")

    def arg(position, default):
        return args[position] if len(args) > position else default

    kernel = _per_dim("kernel_size", args[F_KERNEL], ())
    stride = _per_dim("stride", arg(F_STRIDE, ()), kernel)
    padding = _per_dim("padding", arg(F_PADDING, (0,)), (0,))
    dilation = _per_dim("dilation", arg(F_DILATION, (1,)), (1,))
    ceil_mode = bool(arg(F_CEIL_MODE, False))
    input_shape = _static(source.shape)
    # From the arguments, not the node's meta: executorch's RecomposePadMaxPool2d
    # leaves the recomposed pool's meta wrong until a later pass retraces it.
    out = tuple(
        pooled_size(*per_dim, ceil_mode)
        for per_dim in zip(input_shape[2:], kernel, stride, padding, dilation)
    )
    return MaxPoolBackward(
        grad_output_shape=(*input_shape[:2], *out),
        input_shape=input_shape,
        kernel=kernel,
        stride=stride,
        padding=padding,
        dilation=dilation,
        ceil_mode=ceil_mode,
        dtype=source.dtype,
    )


def pooled_size(i: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    """torch's output size of one pooled dim (``pooling_output_shape`` in ATen)."""
    span = i + 2 * p - d * (k - 1) - 1
    out = (span + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= i + p:
        out -= 1  # the last window must start inside the input or its left padding
    return out


def _is_call(node, target) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target == target


def _same_tensor(a, b, edge_ops) -> bool:
    """``a`` is ``b``, or a ``_to_copy`` of the other: in a quantized graph the backward
    reads the pool's input through a dequantizing copy (``passes/quant_boundary.py``)
    where the pad reads the quantized tensor itself."""
    copy = edge_ops._to_copy.default
    return (
        a is b or (_is_call(a, copy) and a.args[0] is b) or (_is_call(b, copy) and b.args[0] is a)
    )


def index_plane(node: torch.fx.Node, pool: MaxPoolBackward, edge_ops) -> IndexPlane:
    """The plane the node's indices count in (see the module docstring).

    ``edge_ops`` is ``exir_ops.edge.aten``. The padded plane is recognised by
    the graph executorch's RecomposePadMaxPool2d leaves: indices taken from a
    pool with zero padding whose input is a ``constant_pad_nd`` of this node's
    input (or of the tensor a copy of it reads, ``_same_tensor``); the pad amounts (last
    dim first, as torch lists them) give the offset.
    """
    plane = IndexPlane(pool.in_sizes, (0,) * SPATIAL_DIMS)
    indices = node.args[INDICES]
    if not (
        _is_call(indices, operator.getitem)
        and indices.args[1] == 1
        and _is_call(indices.args[0], edge_ops.max_pool2d_with_indices.default)
    ):
        return plane
    forward = indices.args[0]
    pad = forward.args[0]
    forward_padding = forward.args[3] if len(forward.args) > 3 else (0,)
    if not _is_call(pad, edge_ops.constant_pad_nd.default) or any(forward_padding):
        return plane
    amounts = list(pad.args[1])
    if len(amounts) != 2 * SPATIAL_DIMS or not _same_tensor(
        pad.args[0], node.args[INPUT], edge_ops
    ):
        return plane
    before = tuple(amounts[2 * (SPATIAL_DIMS - 1 - d)] for d in range(SPATIAL_DIMS))
    sizes = tuple(int(s) for s in pad.meta["val"].shape[2:])
    return IndexPlane(sizes, before)


# --- avg_pool2d_backward ---------------------------------------------------------------

# Argument positions of ``avg_pool2d_backward(grad_output, self, kernel_size, stride,
# padding, ceil_mode, count_include_pad, divisor_override)`` (same schema file).
(
    A_GRAD_OUTPUT,
    A_INPUT,
    A_KERNEL,
    A_STRIDE,
    A_PADDING,
    A_CEIL_MODE,
    A_COUNT_INCLUDE_PAD,
    A_DIVISOR_OVERRIDE,
) = range(8)


@dataclasses.dataclass(frozen=True)
class AvgPoolBackward(MaxPoolBackward):
    """An average pool's window geometry (the max pool's, dilation 1) and its divisor."""

    count_include_pad: bool = True
    divisor_override: int | None = None

    def divisors(self) -> list[list[int]]:
        """Per output position (``out_sizes``, 2-D), what torch divides its gradient by.

        Window ``o`` spans padded positions ``[o * s, o * s + k)``, input positions from
        ``o * s - p``; torch clips it to the padded input for ``count_include_pad``
        and to the input otherwise (``AvgPoolKernel.cpp``, ``avg_pool2d_backward``).
        """
        if self.divisor_override:
            return [[int(self.divisor_override)] * self.out_sizes[1]] * self.out_sizes[0]
        per_dim = []
        for i, o, k, s, p, _ in self.per_dim():
            counts = []
            for position in range(o):
                start = position * s - p
                end = min(start + k, i + p)
                if not self.count_include_pad:
                    start, end = max(start, 0), min(end, i)
                counts.append(end - start)
            per_dim.append(counts)
        rows, columns = per_dim
        return [[r * c for c in columns] for r in rows]


def parse_avg(node: torch.fx.Node) -> AvgPoolBackward:
    """The ``AvgPoolBackward`` of an ``avg_pool2d_backward`` node; raises
    ``PoolArgumentError`` for arguments it does not describe (a grad_output that is not
    torch's pooled size of the input, a non-positive divisor_override)."""
    args = list(node.args)
    if len(args) != A_DIVISOR_OVERRIDE + 1:
        raise PoolArgumentError(f"{len(args)} arguments, the schema has {A_DIVISOR_OVERRIDE + 1}")
    grad_output = args[A_GRAD_OUTPUT].meta["val"]
    source = args[A_INPUT].meta["val"]
    if grad_output.dim() != SPATIAL_DIMS + 2 or source.dim() != SPATIAL_DIMS + 2:
        raise PoolArgumentError(
            f"grad_output of rank {grad_output.dim()}, input of rank {source.dim()}: "
            "expected 4 (NCHW)"
        )
    kernel = _per_dim("kernel_size", args[A_KERNEL], ())
    divisor = args[A_DIVISOR_OVERRIDE]
    if divisor is not None and int(divisor) <= 0:
        raise PoolArgumentError(f"divisor_override={divisor}")
    pool = AvgPoolBackward(
        grad_output_shape=_static(grad_output.shape),
        input_shape=_static(source.shape),
        kernel=kernel,
        stride=_per_dim("stride", args[A_STRIDE], kernel),
        padding=_per_dim("padding", args[A_PADDING], (0,)),
        dilation=(1,) * SPATIAL_DIMS,
        ceil_mode=bool(args[A_CEIL_MODE]),
        dtype=grad_output.dtype,
        count_include_pad=bool(args[A_COUNT_INCLUDE_PAD]),
        divisor_override=None if divisor is None else int(divisor),
    )
    expected = [pooled_size(i, k, s, p, 1, pool.ceil_mode) for i, _, k, s, p, _ in pool.per_dim()]
    if expected != list(pool.out_sizes) or any(
        p > k // 2 for p, k in zip(pool.padding, pool.kernel)
    ):
        raise PoolArgumentError(
            f"grad_output {list(pool.out_sizes)} is not torch's pooled size {expected} of the "
            f"input {list(pool.in_sizes)} (padding {list(pool.padding)})"
        )
    return pool


def window_elements(kernel) -> int:
    """How many input elements one pooling window covers."""
    count = 1
    for k in kernel:
        count *= k
    return count


def adaptive_windows(in_size: int, out_size: int) -> list[tuple[int, int]]:
    """The input range ``[start, end)`` that each output of an adaptive pool along one
    axis averages: ``start = floor(i * in / out)``, ``end = ceil((i + 1) * in / out)``
    (ATen's ``start_index`` / ``end_index`` in ``AdaptivePooling.h``)."""
    if in_size <= 0 or out_size <= 0:
        raise PoolArgumentError(f"adaptive pool from {in_size} to {out_size} elements")
    return [
        ((i * in_size) // out_size, -((-(i + 1) * in_size) // out_size)) for i in range(out_size)
    ]
