"""fp16 parameters into the delegate, fp16 gradients out of it: would a number change?

A trainable parameter enters the QNN delegate as an fp32 tensor and its gradient
leaves as one, while the HTP computes in fp16. On the x86-64 HTP simulator (SM8650):

* a training step from the parameters rounded to fp16 (``p.half().float()``, round to
  nearest even) gives the same loss and gradients, bit for bit, as from the fp32
  parameters: the delegate reads its fp32 inputs as their fp16 roundings, so fp16
  inputs would give the same step;
* the loss and gradients it writes are not fp16 values: every element is at least one
  fp32 ulp off the fp16 grid (a weight's gradient exactly one, the output's conversion;
  a reduction such as a bias's or a batch norm weight's gradient further, computed
  beyond fp16's precision), so fp16 outputs widened on CPU would change every number.

docs/training.md (what a step costs the host) cites them.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qnn_convbwd
from qnn_convbwd import training
from qnn_convbwd_dev import profile

pytestmark = pytest.mark.htp


def conv_net() -> nn.Module:
    """Two ConvBn blocks in train mode (one strided, one depthwise) and a linear head."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, groups=8),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    ).train()


@pytest.fixture(scope="module")
def lowered(qnn_sdk):
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(4, 3, 8, 8, generator=generator), torch.arange(4)]
    module = training.WithLoss(conv_net(), nn.CrossEntropyLoss())
    program = training.lower_for_training(
        module, tuple(inputs), qnn_convbwd.compile_specs("SM8650")
    )
    return program, inputs


def step(program: training.TrainingProgram, inputs: list, rounded: bool):
    """One forward_backward of a fresh session: (loss, gradients, parameters read)."""
    session = program.session(0.0)
    parameters = session.parameters()
    if rounded:
        with torch.no_grad():
            for p in parameters.values():
                p.copy_(p.half().float())
    read = {n: p.clone() for n, p in parameters.items()}
    loss = session.forward_backward(inputs)[0]
    gradients = session.gradients()
    session.close()
    return loss, gradients, read


def test_the_delegate_reads_fp32_parameters_as_their_fp16_roundings(lowered):
    program, inputs = lowered
    assert len(profile.delegate_io(program.edge)) == 1
    loss, gradients, fp32 = step(program, inputs, rounded=False)
    loss16, gradients16, fp16 = step(program, inputs, rounded=True)
    moved = {n for n in fp32 if not torch.equal(fp32[n], fp16[n])}
    # The rounding moved the convolutions' and the head's weights (batch norms start at
    # 1 and 0, already fp16 values).
    assert {"net.0.weight", "net.3.weight", "net.8.weight", "net.8.bias"} <= moved
    assert torch.equal(loss, loss16)
    for name in gradients:
        assert torch.equal(gradients[name], gradients16[name]), name


def ulps_from_fp16(g: torch.Tensor) -> torch.Tensor:
    """How many fp32 ulps each element is from its fp16 rounding (same sign)."""
    bits = g.contiguous().view(torch.int32).long()
    return (bits - g.half().float().view(torch.int32).long()).abs()


def test_the_delegate_writes_values_fp16_outputs_would_not_hold(lowered):
    program, inputs = lowered
    (delegate,) = profile.delegate_io(program.edge, profile.training_indices(program.pte)[0])
    assert {t.role for t in delegate.outputs} >= {"loss", "gradient"}
    loss, gradients, _ = step(program, inputs, rounded=False)
    for name, g in {"loss": loss.reshape(1), **gradients}.items():
        assert bool((ulps_from_fp16(g) >= 1).all()), name
    for name in ("net.0.weight", "net.3.weight", "net.8.weight"):
        assert int(ulps_from_fp16(gradients[name]).max()) == 1, name
    assert int(ulps_from_fp16(gradients["net.1.weight"]).max()) > 16
