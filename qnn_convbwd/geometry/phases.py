"""grad_input of a strided convolution as stride-1 convolutions, one per output phase.

``Options.stride="phases"`` (sub-pixel decomposition). Per spatial dim, with
input size ``i``, grad_output size ``o``, stride ``s``, padding ``p``, kernel
``k`` (dilation 1), index the *padded* input by ``j = i' + p`` and split it
into phases ``j = q s + c`` with ``c`` in ``[0, s)``. The forward reads input
``j = o' s + t`` at kernel tap ``t``, so phase ``c`` only receives taps
``t = c + s u``: its kernel is the strided slice ``w[c::s]`` with
``K_c = ceil((k - c) / s)`` taps, and

    grad_input_padded[q s + c] = sum_u grad_output[q - u] * w[c + s u]

is element ``q`` of the full stride-1 transposed convolution of grad_output
with that slice (``o + K_c - 1`` elements). Every tap belongs to exactly one
phase, so the phases together do the multiply-adds of the forward
convolution, none on zeros. Phases with ``c >= k`` get no tap: they are zero
and are not computed.

grad_input ``[0, i)`` is ``j`` in ``[p, p + i)``, i.e. ``q`` in
``[p // s, ceil((p + i) / s))``: each phase computes those ``Q`` rows (its
TransposeConv's pad_amount crops the rest; rows beyond its full extent are
zeros appended after it), the phases are interleaved into ``Q s`` rows
starting at ``j = (p // s) s``, and a crop of ``p mod s`` at the start (and
what exceeds ``i`` at the end) leaves grad_input. The output padding of the
transposed convolution is implied by ``i``; no output_padding parameter is used.

Layouts: ``geometry.conv`` (HWOI is the TransposeConv2d filter the slices are
taken from).
"""

from __future__ import annotations

import dataclasses
import itertools

from . import conv as geo


@dataclasses.dataclass(frozen=True)
class Phase:
    """One stride-1 TransposeConv: kernel taps ``offset[d]::stride[d]`` of each dim."""

    offset: tuple[int, ...]  # first kernel tap per spatial dim (the phase c)
    kernel: tuple[int, ...]  # taps per spatial dim: ceil((k - c) / s)
    pad_amount: tuple[tuple[int, int], ...]  # the op's (begin, end) crop per dim
    result_pad_end: tuple[int, ...]  # zero rows appended to the op's result per dim


@dataclasses.dataclass(frozen=True)
class PhasePlan:
    stride: tuple[int, ...]
    kernel: tuple[int, ...]  # the full kernel per spatial dim
    rows: tuple[int, ...]  # Q per dim: the size of every phase's result
    # Phases with taps per dim, ``min(k, s)``; offsets ``[taps, s)`` are zero phases.
    taps: tuple[int, ...]
    phases: tuple[Phase, ...]  # every phase with taps, offsets in row-major order
    crop: tuple[tuple[int, int], ...]  # (begin, end) of the interleaved ``Q s`` per dim
    groups: int

    @property
    def interleaved(self) -> tuple[int, ...]:
        return tuple(q * s for q, s in zip(self.rows, self.stride))


def unsupported_reason(conv: geo.ConvBackward) -> str | None:
    """Why ``stride="phases"`` falls back to ``zero_insert`` for ``conv`` (None: it applies)."""
    if conv.spatial_dims == 3:
        return (
            "3-D: TransposeConv3d crops D by the H pad_amount "
            "(geometry.conv.transpose_conv_applies_padding); 3-D keeps the op's stride"
        )
    if conv.spatial_dims != 2:
        return f"{conv.spatial_dims}-D: the visitor sees 1-D convolutions lifted to 2-D"
    if all(s == 1 for s in conv.stride):
        return "stride 1: one phase, the plain transposed convolution"
    if any(d != 1 for d in conv.dilation):
        return (
            "dilated: the phase slices of a dilated kernel are not implemented "
            f"(dilation={list(conv.dilation)})"
        )
    for i, o, s, p, _, k in conv.per_dim():
        first = p // s
        if o + (k + s - 1) // s - 1 <= first:  # also the longest phase has no row in range
            return f"padding {p} leaves a phase with no row of grad_input (size {i}, stride {s})"
    return None


def plan_phases(conv: geo.ConvBackward) -> PhasePlan:
    """The phase decomposition of ``conv``'s grad_input (see the module docstring)."""
    reason = unsupported_reason(conv)
    if reason is not None:
        raise geo.ConvArgumentError(f"no phase plan: {reason}")
    rows, taps, crop, per_dim = [], [], [], []
    for i, o, s, p, _, k in conv.per_dim():
        first = p // s
        q = (p + i + s - 1) // s - first
        rows.append(q)
        taps.append(min(k, s))
        begin = p - first * s
        crop.append((begin, q * s - begin - i))
        options = []
        for c in range(min(k, s)):
            kernel = (k - c + s - 1) // s
            end = o + kernel - 1 - first - q  # < 0: rows past the op's full extent
            options.append((c, kernel, (first, max(end, 0)), max(-end, 0)))
        per_dim.append(options)
    phases = tuple(
        Phase(
            offset=tuple(c for c, *_ in combo),
            kernel=tuple(kernel for _, kernel, *_ in combo),
            pad_amount=tuple(pad for *_, pad, _ in combo),
            result_pad_end=tuple(extra for *_, extra in combo),
        )
        for combo in itertools.product(*per_dim)
    )
    return PhasePlan(
        stride=tuple(conv.stride),
        kernel=tuple(conv.kernel),
        rows=tuple(rows),
        taps=tuple(taps),
        phases=phases,
        crop=tuple(crop),
        groups=conv.groups,
    )
