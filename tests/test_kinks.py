"""``qnn_convbwd_dev.kinks``: the gate inputs a training step's gradients hinge on.

MobileNetV3-Small at 96 px is outside the fidelity bound on squeeze-excitation
``fc1`` tensors whose ReLU the HTP and torch fp16 round to different sides
(docs/zoo.md, 96 px). These tests check the diagnostic's arithmetic on a model
small enough to flip by hand, and that it finds those flips in the zoo graph.
No SDK needed.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qnn_convbwd_dev import kinks, zoo


@pytest.mark.parametrize(
    ("gate", "want"),
    [
        (nn.ReLU(), ((0.0, 1.0),)),
        (nn.ReLU6(), ((0.0, 1.0), (6.0, 1.0))),
        (nn.Hardsigmoid(), ((-3.0, 1 / 6), (3.0, 1 / 6))),
        (nn.Hardswish(), ((-3.0, 0.5), (3.0, 0.5))),
    ],
)
def test_kinks_are_where_the_slope_jumps_by_that_much(gate, want):
    assert kinks.kinks_of(gate) == want
    for kink, jump in want:
        x = torch.tensor([kink - 1e-4, kink + 1e-4], dtype=torch.float64, requires_grad=True)
        (slopes,) = torch.autograd.grad(gate(x).sum(), x)
        assert abs(float(slopes[1] - slopes[0])) == pytest.approx(jump, abs=1e-3)
    assert kinks.kinks_of(nn.SiLU()) == ()


class _Tiny(nn.Module):
    """Linear -> ReLU -> Linear, MSE: one pre-activation placed just above the kink."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.relu, self.fc2 = nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)
        self.x, self.target = torch.randn(1, 4), torch.randn(1, 3)
        with torch.no_grad():  # pre-activation 2 = +1e-6: inside any fp16 noise
            self.fc1.bias[2] -= self.fc1(self.x)[0, 2] - 1e-6

    def forward(self, x, target):
        return nn.functional.mse_loss(self.fc2(self.relu(self.fc1(x))), target)


def _grads(model, *args):
    model.zero_grad()
    model(*args).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_a_flips_impact_is_the_gradient_change_of_crossing_the_kink():
    model = _Tiny()
    summaries, flips = kinks.find(model, (model.x, model.target), top=3)
    assert [s.gate for s in summaries] == ["relu#1"]
    assert summaries[0].near >= 1
    flip = next(f for f in flips if f.index == (0, 2))
    assert flip.kink == 0.0 and 0 < flip.margin < 1e-4
    before = _grads(model, model.x, model.target)
    with torch.no_grad():  # push the element to -1e-6: the other side of the kink
        model.fc1.bias[2] -= 2e-6
    after = _grads(model, model.x, model.target)
    changes = {n: float((after[n] - before[n]).norm() / before[n].norm()) for n in before}
    # what lies after the gate moves only with the element's value (2e-6), not its slope
    assert changes["fc2.weight"] < 1e-4 and changes["fc2.bias"] < 1e-4
    # fc1's weight gradient is the bias gradient times the input: the same relative change
    assert changes[flip.tensor] == pytest.approx(max(changes.values()), rel=1e-4)
    assert flip.impact == pytest.approx(changes[flip.tensor], rel=1e-3)
    assert flip.impact > 0.01  # the element carries a real share of the gradient


def test_explain_names_the_flip_behind_a_tensor_outside_and_only_then():
    """A stand-in for the HTP that crosses the kink of ``_Tiny``'s element (0, 2)."""
    from qnn_convbwd_dev.fidelity import Metrics, Report, Row

    model = _Tiny()
    _, flips = kinks.find(model, (model.x, model.target), top=None)
    flip = next(f for f in flips if f.index == (0, 2))
    before = _grads(model, model.x, model.target)
    with torch.no_grad():
        model.fc1.bias[2] -= 2e-6
    crossed = _grads(model, model.x, model.target)
    tight = Metrics(max_rel=1e-3, rel_l2=1e-3, cosine=1.0)  # a floor the flip exceeds
    # fc1.weight: outside by 3x the flip's impact, with a floor whose limit the flip
    # alone does not reach: outside, but not by this flip
    loose = Metrics(max_rel=1.0, rel_l2=flip.impact / 2, cosine=0.0)
    report = Report(
        [
            Row("fc1.bias", Metrics.of(crossed["fc1.bias"], before["fc1.bias"]), tight),
            Row("fc2.bias", Metrics.of(crossed["fc2.bias"], before["fc2.bias"]), tight),
            Row(
                "fc1.weight",
                Metrics.of(before["fc1.weight"] * (1 + 3 * flip.impact), before["fc1.weight"]),
                loose,
            ),
            Row("loss", Metrics(max_rel=0.5, rel_l2=0.5, cosine=1.0), tight),
        ]
    )
    causes = {c.tensor: c for c in kinks.explain(report, flips)}
    assert set(causes) == {"fc1.bias", "fc1.weight", "loss"}  # fc2.bias is within
    bias = causes["fc1.bias"]
    assert bias.explained and bias.flips[0].index == (0, 2)
    assert bias.flips[0].impacts["fc1.bias"] == pytest.approx(flip.impact, rel=1e-3)
    assert "relu#1 [0, 2]" in bias.describe()
    weight = causes["fc1.weight"]
    assert not weight.explained and weight.largest.index == (0, 2)
    assert "no single gate flip puts it outside" in weight.describe()
    assert causes["loss"].largest is None and "not a kink flip" in causes["loss"].describe()


def test_a_model_that_trains_nothing_is_refused():
    model = _Tiny().requires_grad_(False)
    with pytest.raises(ValueError, match="nothing is trained"):
        kinks.find(model, (model.x, model.target))


def test_mobilenet_v3_small_96px_hinges_on_squeeze_excitation_relus():
    """The flips docs/zoo.md measured by hand at 96 px, found by the tool."""
    try:
        model, inputs = zoo.step("mobilenet_v3_small", "bias_only", 96)
    except zoo.TorchvisionUnavailable as err:
        pytest.skip(str(err))
    _, flips = kinks.find(model, inputs, top=12)
    decisive = {(f.gate, f.index[1]): f for f in flips if f.decisive}
    # block 11's fc1 channel 64: 3.8e-3 of the rms below zero, moves fc1.bias by 0.471
    found = decisive[("net.features.11.block.2.activation#1", 64)]
    assert found.tensor == "net.features.11.block.2.fc1.bias"
    assert found.impact == pytest.approx(0.471, abs=0.01)
    assert abs(found.margin) < found.noise  # inside the forward's fp16 noise
    assert ("net.features.9.block.2.activation#1", 31) in decisive
    # every decisive flip sits at a pooled (1x1) squeeze-excitation gate, none in a spatial map
    assert all(".block.2.activation" in gate for gate, _ in decisive)
