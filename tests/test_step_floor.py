"""``qnn_convbwd_dev.step_floor``: a training step's loss and running statistics judged
over the input and its neighbours (CPU, no SDK)."""

from __future__ import annotations

import math

import pytest
import torch

from qnn_convbwd_dev import step_floor

LOSS = 2.3  # a 10-class cross-entropy at random weights: relative bound 6.9e-2


def _losses(gaps: list[float], fp32: float = LOSS, sign: float = 1.0) -> list[float]:
    return [fp32 + sign * g for g in gaps]


def test_loss_bound_is_the_relative_floor_or_twice_fp16s_gap():
    assert step_floor.loss_bound(0.5, 0.0) == pytest.approx(3e-2)  # |loss| < 1 counts as 1
    assert step_floor.loss_bound(-10.0, 0.1) == pytest.approx(0.3)
    assert step_floor.loss_bound(2.0, -0.05) == pytest.approx(0.1)  # the gap's size


def test_the_median_passes_a_program_the_input_alone_fails():
    """The input's fp16 draw is the lucky one (1e-2): one draw bounds the program at 6.9e-2
    and it is 0.1 off there; over five draws it is as far off as torch fp16 (median 5e-2
    against 3e-2 and a bound of 6.9e-2)."""
    fp32 = [LOSS] * 5
    ours = _losses([0.10, 0.05, 0.06, 0.04, 0.05])
    fp16 = _losses([0.01, 0.03, 0.04, 0.02, 0.05], sign=-1.0)
    assert abs(ours[0] - fp32[0]) > step_floor.loss_bound(fp32[0], fp16[0] - fp32[0])
    verdict = step_floor.loss_verdict(ours, fp32, fp16)
    assert verdict.error == pytest.approx(0.05) and verdict.floor == pytest.approx(0.03)
    assert verdict.bound == pytest.approx(3e-2 * LOSS) and verdict.within


def test_the_median_fails_a_program_off_on_most_draws_the_input_alone_passes():
    """Three draws in five at 3x torch fp16's gap: the input's own draw is within, the
    median is not."""
    fp32 = [LOSS] * 5
    ours = _losses([0.05, 0.3, 0.3, 0.3, 0.05])
    fp16 = _losses([0.1] * 5)
    assert abs(ours[0] - fp32[0]) <= step_floor.loss_bound(fp32[0], fp16[0] - fp32[0])
    verdict = step_floor.loss_verdict(ours, fp32, fp16)
    assert verdict.error == pytest.approx(0.3) and verdict.bound == pytest.approx(0.2)
    assert not verdict.within


def test_the_loss_bound_scales_with_the_median_loss():
    fp32 = [9.0, 10.0, 11.0]
    verdict = step_floor.loss_verdict([9.2, 10.25, 11.3], fp32, fp32)
    assert verdict.floor == 0.0 and verdict.bound == pytest.approx(0.3)
    assert verdict.error == pytest.approx(0.25) and verdict.within


def test_running_statistics_by_the_median_of_each_draws_worst_error():
    within = step_floor.statistics_verdict([0.33, 0.2, 0.9, 0.31], [0.3, 0.15, 0.16, 0.2])
    assert within.error == pytest.approx(0.32) and within.floor == pytest.approx(0.18)
    assert within.bound == pytest.approx(0.36) and within.within
    assert not step_floor.statistics_verdict([0.5, 0.4, 0.45], [0.2, 0.1, 0.15]).within
    # fp16 exact: the absolute floor of 1e-2
    assert step_floor.statistics_verdict([9e-3], [0.0]).within
    assert not step_floor.statistics_verdict([1.1e-2], [0.0]).within


def test_fp16_pass_fraction_on_a_hand_made_step():
    """fp16 gaps 0.01, 0.05, 0.2 at a loss of 1 (relative floor 0.03): 0.01 passes both
    other bounds; 0.05 passes 0.2's (0.4), not 0.01's (0.03); 0.2 passes neither
    (0.03, 0.1). Three of six ordered pairs."""
    fp32 = [1.0, -1.0, 1.0]
    fp16 = [1.01, -1.05, 0.8]
    assert step_floor.fp16_pass_fraction(fp32, fp16) == pytest.approx(0.5)
    assert step_floor.fp16_pass_fraction(fp32, fp32) == 1.0


def test_fp16_pass_fraction_of_iid_gaps_is_the_two_to_one_odds():
    """Gaps of independent, equally distributed normal errors, far above the relative floor:
    a draw is within twice another's with probability (2 / pi) * atan(2) = 0.705."""
    generator = torch.Generator().manual_seed(0)
    gaps = (torch.randn(300, generator=generator, dtype=torch.float64) * 100).tolist()
    fraction = step_floor.fp16_pass_fraction([0.0] * len(gaps), gaps)
    assert fraction == pytest.approx(2 / math.pi * math.atan(2), abs=0.03)


def test_draws_must_pair_up():
    with pytest.raises(ValueError, match="one value per draw"):
        step_floor.loss_verdict([1.0, 2.0], [1.0], [1.0])
    with pytest.raises(ValueError, match="one value per draw"):
        step_floor.statistics_verdict([], [])
    with pytest.raises(ValueError, match="at least two draws"):
        step_floor.fp16_pass_fraction([1.0], [1.0])
