"""Losses and running statistics of training steps, judged against torch fp16's own noise.

``scripts/train_mode_zoo.py`` compares each step's loss with torch eager fp32 and
allows ``3e-2 * max(1, |loss|)`` or twice torch fp16's own gap, whichever is larger
(``loss_bound``). Torch fp16's gap on one input is one draw of a scalar: where it
happens to be small, the bound is tight for any fp16 computation, torch's own
included. Over the input and its ``fidelity.neighbours`` (inputs moved by at most
one fp16 rounding, the same step as far as fp16 can tell) the draws are fp16's noise
on that step:

* ``loss_verdict``: the median over the draws of the program's gap, within the bound
  built from the median of torch fp16's gaps;
* ``statistics_verdict``: the same for the running statistics, one number per draw
  (its worst relative error), within ``1e-2`` or twice the median of torch fp16's;
* ``fp16_pass_fraction``: how often a computation exactly as good as torch fp16
  passes the one-draw bound, measured over ordered pairs of draws (one draw's fp16
  gap judged by another's bound).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence

LOSS_RELATIVE = 3e-2  # of max(1, |loss|)
STATISTICS_ABSOLUTE = 1e-2  # relative error of a running statistic
FLOOR_FACTOR = 2.0  # times torch fp16's own error


def loss_bound(loss: float, fp16_gap: float) -> float:
    """The allowed gap of a loss ``loss`` (fp32) where torch fp16 is ``fp16_gap`` off."""
    return max(LOSS_RELATIVE * max(1.0, abs(loss)), FLOOR_FACTOR * abs(fp16_gap))


def statistics_bound(fp16_error: float) -> float:
    """The allowed relative error of a running statistic where torch fp16's is ``fp16_error``."""
    return max(STATISTICS_ABSOLUTE, FLOOR_FACTOR * fp16_error)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A median error against the bound built from the median of torch fp16's."""

    error: float  # median over the draws of the program's error
    floor: float  # median over the draws of torch fp16's error
    bound: float

    @property
    def within(self) -> bool:
        return self.error <= self.bound


def _check_lengths(*series: Sequence[float]) -> None:
    lengths = {len(s) for s in series}
    if len(lengths) != 1 or 0 in lengths:
        raise ValueError(f"need one value per draw, equally many and at least one: {lengths}")


def loss_verdict(ours: Sequence[float], fp32: Sequence[float], fp16: Sequence[float]) -> Verdict:
    """One step's losses over the draws (the program's, torch fp32's, torch fp16's; same
    order): the median of ``|ours_k - fp32_k|`` within ``loss_bound`` of the median
    ``|fp32_k|`` and the median ``|fp16_k - fp32_k|``."""
    _check_lengths(ours, fp32, fp16)
    floor = statistics.median(abs(h - r) for h, r in zip(fp16, fp32))
    return Verdict(
        error=statistics.median(abs(o - r) for o, r in zip(ours, fp32)),
        floor=floor,
        bound=loss_bound(statistics.median(abs(r) for r in fp32), floor),
    )


def statistics_verdict(ours: Sequence[float], fp16: Sequence[float]) -> Verdict:
    """One step's running statistics over the draws, each draw's worst relative error
    against torch fp32 (the program's, torch fp16's): median within ``statistics_bound``
    of the median of torch fp16's."""
    _check_lengths(ours, fp16)
    floor = statistics.median(fp16)
    return Verdict(error=statistics.median(ours), floor=floor, bound=statistics_bound(floor))


def fp16_pass_fraction(fp32: Sequence[float], fp16: Sequence[float]) -> float:
    """Over ordered pairs ``j != k`` of draws, the fraction where torch fp16's gap on
    draw ``j`` is within the one-draw bound that draw ``k``'s fp16 gap would set:
    ``|fp16_j - fp32_j| <= loss_bound(fp32_j, |fp16_k - fp32_k|)``. An estimate of how
    often a computation as good as torch fp16, independent of it, passes the one-draw
    bound on this step."""
    _check_lengths(fp32, fp16)
    if len(fp32) < 2:
        raise ValueError("a pass fraction needs at least two draws")
    gaps = [abs(h - r) for h, r in zip(fp16, fp32)]
    passed = [
        gaps[j] <= loss_bound(fp32[j], gaps[k])
        for j in range(len(gaps))
        for k in range(len(gaps))
        if j != k
    ]
    return sum(passed) / len(passed)
