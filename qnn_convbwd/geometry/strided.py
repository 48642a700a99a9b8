"""When an ``as_strided_scatter`` is a padded block of its source.

``as_strided_scatter(base, src, size, stride, offset)`` is ``base`` cloned (contiguous,
as the joint graphs' bases are) with ``src`` written into the view
``out.as_strided(size, stride, offset)``; schema:
https://github.com/pytorch/pytorch/blob/main/aten/src/ATen/native/native_functions.yaml
(``as_strided_scatter``). It appears in the backward of an ``as_strided`` view, for
instance one that restrides a pooled 1x1 map.

The view is a *block* of the base when the base, read as some contiguous shape
``sizes``, holds the view's elements at the indices ``start + i`` (``i`` the view's
index, one base dim per view dim): then the result is ``src`` (reshaped to the
block's shape) padded with the base's values on every side, and, when the block
covers the whole base, ``src`` reshaped. ``block`` finds that shape or says why
there is none (overlapping or broadcast elements, strides that do not nest, a view
past the base's end): the scatter then stays as it is.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence


class NotABlock(ValueError):
    """The view is not a block of its base (the message says why)."""


@dataclasses.dataclass(frozen=True)
class Block:
    """The base read as the contiguous shape ``sizes``; the view is the block of shape
    ``shape`` starting at ``start`` in it."""

    sizes: tuple[int, ...]
    start: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def pads(self) -> tuple[tuple[int, int], ...]:
        """Per dim of ``sizes``: how many base elements before and after the block."""
        return tuple(
            (s, n - s - k) for n, s, k in zip(self.sizes, self.start, self.shape, strict=True)
        )

    @property
    def covers(self) -> bool:
        """True when the block is the whole base (no pad)."""
        return self.shape == self.sizes


def block(base_numel: int, size: Sequence[int], stride: Sequence[int], offset: int = 0) -> Block:
    """The block of a contiguous base of ``base_numel`` elements that the view
    (``size``, ``stride``, ``offset``) is; raises ``NotABlock`` when it is none."""
    if len(size) != len(stride):
        raise NotABlock(f"size {list(size)} and stride {list(stride)} differ in length")
    if any(s < 0 for s in size) or offset < 0:
        raise NotABlock(f"negative size or offset (size={list(size)}, offset={offset})")
    if math.prod(size) == 0:
        raise NotABlock(f"the view is empty (size={list(size)})")
    # Dims of one element read one element whatever their stride.
    dims = [(n, t) for n, t in zip(size, stride, strict=True) if n != 1]
    if not dims or dims[-1][1] != 1:
        dims.append((1, 1))  # a unit dim of stride 1: the innermost base dim
    strides = [t for _, t in dims]
    for outer, inner in zip(strides, strides[1:]):
        if inner <= 0 or outer <= inner or outer % inner:
            raise NotABlock(
                f"strides {list(stride)} do not nest (each a multiple of the next, larger)"
            )
    if base_numel % strides[0]:
        raise NotABlock(
            f"the outermost stride {strides[0]} does not divide the base's {base_numel} elements"
        )
    # The base as a contiguous shape whose strides are the view's.
    sizes = [base_numel // strides[0]] + [o // i for o, i in zip(strides, strides[1:])]
    start = [offset // strides[0]] + [
        (offset // t) % n for t, n in zip(strides[1:], sizes[1:], strict=True)
    ]
    shape = [n for n, _ in dims]
    for dim, (s, k, n) in enumerate(zip(start, shape, sizes, strict=True)):
        if s + k > n:
            raise NotABlock(
                f"the view (size={list(size)}, stride={list(stride)}, offset={offset}) is no "
                f"block of the base read as {sizes}: dim {dim} needs {s} + {k} > {n} elements"
            )
    return Block(tuple(sizes), tuple(start), tuple(shape))
