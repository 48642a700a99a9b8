"""A tensor permutation in its smallest form: unit dims dropped, adjacent dims merged.

``scripts/lowering_time.py`` builds with it the collapsed formulation of a
weight permutation, to measure what QAIRT's finalisation costs for it against
the rank-4 Transpose the builders emit (docs/lowering_time.md: it was not
cheaper, so the builders do not use it).

A permutation ``perm`` of a tensor of shape
``shape`` (result dim ``i`` is source dim ``perm[i]``) moves the same elements
as the Transpose of a collapsed view:

* dims of size 1 carry no order and are dropped;
* source dims that follow each other in the source and stay next to each
  other, in the same order, in the result are one dim of the view.

``collapse`` computes that view: a Reshape of the source to ``source_shape``, a
Transpose by ``perm`` (none when it is the identity) and a Reshape to the
result's shape produce the permuted tensor. OIHW -> HWIO of a 1x1 kernel is a
rank-2 transpose ``[O, I] -> [I, O]``; of a 3x3 kernel a rank-3 one
``[O, I, 9] -> [9, I, O]``; ``[I, kH, kW, O] -> OIHW`` is ``[I*kH*kW, O] -> [O, I*kH*kW]``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Collapsed:
    """``perm`` of ``shape`` as a Transpose of the view ``source_shape``."""

    source_shape: tuple[int, ...]  # the view of the source the Transpose reads
    perm: tuple[int, ...]  # of ``source_shape``
    result_shape: tuple[int, ...]  # the permuted tensor's shape (uncollapsed)

    @property
    def transposes(self) -> bool:
        """Whether elements move (else a Reshape alone makes the result)."""
        return self.perm != tuple(range(len(self.perm)))

    @property
    def permuted_shape(self) -> tuple[int, ...]:
        """Shape the Transpose produces (the result's, collapsed)."""
        return tuple(self.source_shape[i] for i in self.perm)


def collapse(shape: Sequence[int], perm: Sequence[int]) -> Collapsed:
    """The smallest Transpose that does ``perm`` (result dim i = source dim perm[i])."""
    shape = tuple(int(v) for v in shape)
    perm = tuple(int(p) for p in perm)
    if sorted(perm) != list(range(len(shape))):
        raise ValueError(f"{perm} is not a permutation of the {len(shape)} dims of {shape}")
    result_shape = tuple(shape[p] for p in perm)
    kept = [d for d in range(len(shape)) if shape[d] != 1]
    position = {d: i for i, d in enumerate(kept)}
    groups: list[list[int]] = []  # source dims of each view dim, in result order
    for d in (p for p in perm if shape[p] != 1):
        if groups and position[d] == position[groups[-1][-1]] + 1:
            groups[-1].append(d)
        else:
            groups.append([d])
    in_source_order = sorted(groups, key=lambda g: g[0])
    source_shape = tuple(math.prod(shape[d] for d in g) for g in in_source_order)
    view_perm = tuple(in_source_order.index(g) for g in groups)
    return Collapsed(source_shape, view_perm, result_shape)
