"""``qnn_convbwd_dev.gate_match``: a training step judged with each side's own gate decisions.

MobileNetV3-Small fully trained at 32 px is outside the fidelity bound on its
first squeeze-excitation ``fc1`` because the HTP's forward rounds other gate
elements across a kink than torch fp16 does (docs/zoo.md). These
tests check the pieces on a model with every gate kind: the gate tensors a
joint program is given as outputs are the ones its backward compares, in call
order; fp32 on a side tensor's decisions is the fp32 step when the sides are
fp32's own and moves exactly the flipped slope otherwise; and, on the HTP
simulator, the gated lowering computes the same bits as the plain one.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.export.experimental import _export_forward_backward

from qnn_convbwd_dev import fidelity, gate_match, kinks, models


class _SqueezeExcite(nn.Module):
    def __init__(self, channels: int, squeezed: int) -> None:
        super().__init__()
        self.fc1, self.relu = nn.Conv2d(channels, squeezed, 1), nn.ReLU()
        self.fc2, self.gate = nn.Conv2d(squeezed, channels, 1), nn.Hardsigmoid()

    def forward(self, x):
        pooled = x.mean((2, 3), keepdim=True)
        return x * self.gate(self.fc2(self.relu(self.fc1(pooled))))


class _EveryGate(nn.Module):
    """Conv, batch norm, in-place ReLU, squeeze-excitation (ReLU, Hardsigmoid),
    Hardswish, ReLU6, a linear head; MSE. Every parameter trains."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.act = nn.ReLU(inplace=True)
        self.se, self.swish, self.relu6 = _SqueezeExcite(8, 4), nn.Hardswish(), nn.ReLU6()
        self.head = nn.Linear(8, 5)
        self.eval()

    def forward(self, x, target):
        y = self.relu6(self.swish(self.se(self.act(self.bn(self.conv(x))))))
        return nn.functional.mse_loss(self.head(y.mean((2, 3))), target)


def _step():
    model = _EveryGate()
    inputs = (torch.randn(1, 3, 8, 8), torch.randn(1, 5))
    joint = _export_forward_backward(torch.export.export(model, inputs, strict=True))
    return model, inputs, joint


def _run_eager(program: torch.export.ExportedProgram, inputs) -> list[torch.Tensor]:
    """Every output of ``program``'s graph (its out spec holds only the loss)."""
    user = iter(inputs)
    args = []
    for spec in program.graph_signature.input_specs:
        if spec.kind.name == "USER_INPUT":
            args.append(next(user))
        elif spec.target in program.state_dict:
            args.append(program.state_dict[spec.target])
        else:
            args.append(program.constants[spec.target])
    return list(program.graph_module(*args))


def _fp32_sides(model, inputs):
    sides = []
    with torch.no_grad():
        kinks.hooked_forward(kinks.not_in_place(model), inputs, lambda g, k, x, y: sides.append(x))
    return sides


def test_the_gate_outputs_are_what_each_backward_compares_in_call_order():
    model, inputs, joint = _step()
    gated = gate_match.with_gate_outputs(joint, model, inputs)
    assert gated.gates == ("act#1", "se.relu#1", "se.gate#1", "swish#1", "relu6#1")
    own, sides = gated.split(_run_eager(gated.program, inputs))
    plain = _run_eager(joint, inputs)
    assert len(own) == len(plain) and all(torch.equal(a, b) for a, b in zip(own, plain))
    gates = dict(model.named_modules())
    for name, side, x in zip(gated.gates, sides, _fp32_sides(model, inputs)):
        module = gates[name.split("#")[0]]
        # ReLU's backward compares its output, the others their input: the same slopes
        assert torch.equal(gate_match.slope(module, x, side), gate_match.slope(module, x, x))
    assert not torch.equal(sides[0], _fp32_sides(model, inputs)[0])  # ReLU: its output


def test_fp32_on_its_own_sides_is_the_fp32_step():
    model, inputs, joint = _step()
    matched = gate_match.matched_step(model, inputs, joint, _fp32_sides(model, inputs))
    for got, want in zip(matched, models.autograd_reference(model, inputs, joint)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)


def test_a_side_across_the_kink_moves_only_that_elements_slope():
    """The squeeze-excitation ReLU of one channel flipped: fc1's bias gradient loses
    exactly that channel (ReLU's slope 1 -> 0), every other gradient before the gate
    keeps its other channels, and nothing after the gate moves."""
    model, inputs, joint = _step()
    sides = _fp32_sides(model, inputs)
    names = fidelity.output_names(joint)
    want = dict(zip(names, models.autograd_reference(model, inputs, joint)))
    channel = int(torch.nonzero(sides[1].flatten() > 0)[0])
    sides[1] = sides[1].clone()
    sides[1].view(-1)[channel] = -sides[1].view(-1)[channel]
    got = dict(zip(names, gate_match.matched_step(model, inputs, joint, sides)))
    assert float(got["se.fc1.bias"][channel]) == 0.0 and float(want["se.fc1.bias"][channel]) != 0
    keep = [c for c in range(got["se.fc1.bias"].numel()) if c != channel]
    torch.testing.assert_close(got["se.fc1.bias"][keep], want["se.fc1.bias"][keep])
    for name in ("se.fc2.weight", "se.fc2.bias", "head.weight", "head.bias"):
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-9)
    counts = gate_match.flipped(model, inputs, sides)
    assert counts == {"act#1": 0, "se.relu#1": 1, "se.gate#1": 0, "swish#1": 0, "relu6#1": 0}


def test_assess_judges_each_side_on_its_own_gates():
    """torch fp16's step as the 'HTP': on its own gates it is its own floor."""
    model, inputs, joint = _step()
    half = fidelity.fp16_reference(model, inputs, joint)
    matched = gate_match.assess(model, inputs, joint, half, gate_match.fp16_sides(model, inputs))
    assert matched.report.within
    assert all(r.htp == r.floor for r in matched.report.rows)
    assert matched.flips_htp == matched.flips_fp16


def test_a_gate_written_as_a_function_cannot_be_paired_and_says_so():
    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.relu = nn.Linear(4, 4), nn.ReLU()

        def forward(self, x, target):
            return nn.functional.mse_loss(self.relu(torch.relu(self.fc(x))), target)

    model = Functional()
    inputs = (torch.randn(2, 4), torch.randn(2, 4))
    joint = _export_forward_backward(torch.export.export(model, inputs, strict=True))
    with pytest.raises(ValueError, match="2 tensors compared .* 1 gate module calls"):
        gate_match.with_gate_outputs(joint, model, inputs)


def test_on_the_htp_the_gated_lowering_computes_the_plain_lowerings_bits(qnn_sdk):
    from qnn_convbwd.toolchain import harness

    model, inputs, joint = _step()
    ops = [str(n.target) for n in joint.graph.nodes]
    plain = harness.lower_program(joint, "SM8650").run(list(inputs))
    # the lowering left the program it was given as it was (executorch's export
    # passes rewrite theirs in place: scalar comparisons became tensor ones)
    assert [str(n.target) for n in joint.graph.nodes] == ops
    gated = gate_match.with_gate_outputs(joint, model, inputs)
    own, sides = gated.split(harness.lower_program(gated.program, "SM8650").run(list(inputs)))
    assert len(own) == len(plain) and all(torch.equal(a, b) for a, b in zip(own, plain))
    assert len(sides) == len(gated.gates)
    matched = gate_match.assess(model, inputs, joint, own, sides)
    assert matched.report.within, matched.report.verdict()
