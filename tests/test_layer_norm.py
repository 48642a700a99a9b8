"""Layer norms with a trainable weight and bias (ConvNeXt's LayerNorm2d) on the HTP
(passes/layer_norm.py): the rewrite computes the same on CPU, and a training step on
the simulator matches torch within its fp16 error."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import qnn_convbwd
from qnn_convbwd import training
from qnn_convbwd.passes import layer_norm


class _LayerNorm2d(nn.LayerNorm):
    """ConvNeXt's LayerNorm2d: over channels, NCHW in and out."""

    def forward(self, x):
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3)
        self.norm = _LayerNorm2d(8, eps=1e-6)
        self.conv2 = nn.Conv2d(8, 8, 3)
        self.head = nn.Linear(8 * 4 * 4, 5)

    def forward(self, x):
        x = self.conv2(self.norm(self.conv1(x)))
        return self.head(x.flatten(1))


@functools.cache
def _case():
    torch.manual_seed(0)
    net = _Net()
    with torch.no_grad():  # not the identity affine of a fresh LayerNorm
        net.norm.weight.uniform_(0.5, 1.5)
        net.norm.bias.uniform_(-0.5, 0.5)
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 4])
    joint = training.export_joint(
        training.WithLoss(copy.deepcopy(net), nn.functional.cross_entropy), (x, y)
    )
    return net, x, y, joint


def _steps(net, x, y, dtype):
    model = copy.deepcopy(net).to(dtype)
    loss = nn.functional.cross_entropy(model(x.to(dtype)).float(), y)
    loss.backward()
    return float(loss), {n: p.grad.double() for n, p in model.named_parameters()}


def _run(edge, x, y):
    """The edge program's graph on its parameters, buffers and (x, y)."""
    values = {**edge.state_dict, **edge.constants}
    user = iter([x, y])
    args = [
        values[spec.target] if spec.target is not None else next(user)
        for spec in edge.graph_signature.input_specs
    ]
    return edge.graph_module(*args)


@pytest.mark.slow(reason="to_edge of a joint graph on CPU; the simulator step covers the rewrite")
def test_the_rewrite_computes_the_same_on_cpu():
    from executorch.exir import to_edge

    net, x, y, joint = _case()
    with qnn_convbwd.enabled():
        edge = to_edge(copy.deepcopy(joint)).exported_program()
    before = _run(edge, x, y)
    assert layer_norm.rewrite_trainable_layer_norms(edge.graph_module, edge) == 1
    calls = [n.target.__name__ for n in edge.graph.nodes if n.op == "call_function"]
    assert not any("layer_norm" in c for c in calls) and "aten.rsqrt.default" in calls
    after = _run(edge, x, y)
    assert len(before) == len(after) > 1
    for a, b in zip(before, after):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_training_step_on_htp_next_to_torch(qnn_sdk):
    """Loss and every gradient within twice torch fp16's own error (relative L2) plus 1e-3."""
    from qnn_convbwd.toolchain import harness
    from qnn_convbwd_dev import fidelity

    net, x, y, joint = _case()
    compiled = harness.lower_program(joint, "SM8650")
    left = [str(n.target) for n in compiled.edge.exported_program().graph.nodes]
    assert not [t for t in left if "layer_norm" in t or "rsqrt" in t]
    outputs = dict(zip(fidelity.output_names(joint), compiled.run([x, y])))
    loss32, grads32 = _steps(net, x, y, torch.float32)
    loss16, grads16 = _steps(net, x, y, torch.float16)
    assert abs(float(outputs["loss"]) - loss32) <= 2 * abs(loss16 - loss32) + 1e-3
    for name, reference in grads32.items():
        scale = reference.norm()
        error = float((outputs[f"net.{name}"].double() - reference).norm() / scale)
        floor = float((grads16[name] - reference).norm() / scale)
        assert error <= 2 * floor + 1e-3, f"{name}: {error:.2e} against torch fp16 {floor:.2e}"
