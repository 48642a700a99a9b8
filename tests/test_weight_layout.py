"""Trainable convolution weights entering the delegate as HWIO (``weight_layout="hwio"``).

The same joint program is lowered with the weights in torch's layout and in
the QNN filter layout; the QNN graph must then take each trained weight as an
``[kH, kW, I, O]`` input and return its gradient in that shape, the program
must compute what the torch-layout lowering computes, and training through
ExecuTorch's runtime must keep torch's parameter shapes.
"""

from __future__ import annotations

import pytest
import torch

import qnn_convbwd
from qnn_convbwd import integration, training
from qnn_convbwd.meta import GRAD_TO_TORCH, GRAD_VIEW, WEIGHT_TO_DEVICE, WEIGHT_VIEW
from qnn_convbwd.toolchain import harness
from qnn_convbwd_dev import models

pytestmark = pytest.mark.htp

SOC = "SM8650"
LAYOUTS = ("torch", "hwio")


def _lower(case: models.TrainingCase, layout: str):
    with qnn_convbwd.enabled(weight_layout=layout), integration.capture_qnn_graphs() as graphs:
        result = qnn_convbwd.lower(case.joint(), harness.compile_specs(SOC))
        pte = result.edge.to_executorch().buffer
    return result, graphs, pte


@pytest.fixture(scope="module")
def demo(demo_on_sm8650):
    """The trainable demo lowered in both layouts: the filter layout is the default, so
    that lowering is conftest's ``demo_on_sm8650``, shared with test_training."""
    case, result, graphs, _, pte = demo_on_sm8650(True)
    return case, {"hwio": (result, graphs, pte), "torch": _lower(case, "torch")}


def _conv_weights(case: models.TrainingCase) -> dict[str, torch.Tensor]:
    """Placeholder name -> trained 4-D weight."""
    return {
        "p_" + name.replace(".", "_"): p
        for name, p in case.model.named_parameters()
        if p.requires_grad and p.dim() == 4
    }


def _moved(result, key: str) -> list[str]:
    """The weights whose permutes of kind ``key`` are in the top-level program."""
    graph = result.edge.exported_program().graph
    permutes = [n for n in graph.nodes if "permute_copy" in str(n.target)]
    return sorted(n.meta[key] for n in permutes if n.meta.get(key))


def test_weights_enter_and_gradients_leave_in_the_filter_layout(demo):
    case, lowered = demo
    result, graphs, _ = lowered["hwio"]
    weights = _conv_weights(case)
    assert len(weights) >= 2
    # The permutes to and from torch's layout run on CPU, one pair per weight.
    for key in (WEIGHT_TO_DEVICE, GRAD_TO_TORCH):
        assert _moved(result, key) == sorted(weights), key
    for key in (WEIGHT_VIEW, GRAD_VIEW):  # the inner ones went into the delegate
        assert not _moved(result, key), key
    tensors = {t.name: t for ops in graphs for op in ops for t in (*op.inputs, *op.outputs)}
    inputs = [t for t in tensors.values() if t.kind.endswith("APP_WRITE")]
    outputs = [t for t in tensors.values() if t.kind.endswith("APP_READ")]
    for name, weight in weights.items():
        hwio = tuple(weight.permute(2, 3, 1, 0).shape)
        assert sum(t.dims == hwio for t in inputs) >= 1, (name, hwio)
        assert sum(t.dims == hwio for t in outputs) >= 1, (name, hwio)
        # no tensor of the QNN graph holds the weight or its gradient as OIHW
        assert not [t.name for t in tensors.values() if t.dims == tuple(weight.shape)], name
    # in torch's layout the same graphs read and write OIHW tensors
    _, torch_graphs, _ = lowered["torch"]
    torch_dims = {t.dims for ops in torch_graphs for op in ops for t in (*op.inputs, *op.outputs)}
    assert {tuple(w.shape) for w in weights.values()} <= torch_dims


def test_the_program_computes_what_the_torch_layout_computes(demo):
    case, lowered = demo
    runs = {
        layout: harness.run_pte(pte, list(case.inputs)) for layout, (_, _, pte) in lowered.items()
    }
    assert len(runs["hwio"]) == len(runs["torch"])
    for ours, theirs in zip(runs["hwio"], runs["torch"]):
        assert ours.shape == theirs.shape
        # the same fp16 arithmetic; the permutes move elements exactly
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


class _Shapes(torch.nn.Module):
    """Strided, grouped, dilated, pointwise and 3-D convolutions, every weight trained.

    The pointwise ones' grad_weight is a MatMul whose operand order follows the
    layout (``[C_in, C_out]`` for HWIO, ``[C_out, C_in]`` for OIHW)."""

    def __init__(self) -> None:
        super().__init__()
        self.strided = torch.nn.Conv2d(4, 8, 3, stride=2, padding=1)
        self.grouped = torch.nn.Conv2d(8, 8, 3, padding=2, dilation=2, groups=2, bias=False)
        self.pointwise = torch.nn.Conv2d(8, 6, 1)
        self.downsample = torch.nn.Conv2d(4, 6, 1, stride=2, bias=False)
        self.volume = torch.nn.Conv3d(2, 4, (2, 3, 1), stride=(1, 2, 1))

    def forward(self, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        y = self.grouped(torch.relu(self.strided(x)))
        y = self.pointwise(torch.relu(y)) + self.downsample(x)
        return y.square().mean() + self.volume(v).square().mean()


def test_other_convolutions_compute_what_the_torch_layout_computes(qnn_sdk):
    """The same comparison for strided, grouped, dilated and 3-D convolutions, and the
    gradients against eager autograd."""
    torch.manual_seed(0)
    case = models.TrainingCase(
        "shapes", _Shapes(), (torch.randn(1, 4, 9, 9), torch.randn(1, 2, 4, 7, 3))
    )
    lowered = {layout: _lower(case, layout) for layout in LAYOUTS}
    runs = {layout: harness.run_pte(run[2], list(case.inputs)) for layout, run in lowered.items()}
    # the forward and the backward land in two delegates: each reads the weight as HWIO
    _, graphs, _ = lowered["hwio"]
    assert len(graphs) == 2
    for layout, product in (("hwio", [(8, 6), (4, 6)]), ("torch", [(6, 8), (6, 4)])):
        ops = [op for ops in lowered[layout][1] for op in ops]
        assert sorted(op.outputs[0].dims for op in ops if op.op_type == "MatMul") == sorted(
            product
        ), layout
    dims = {t.dims for ops in graphs for op in ops for t in (*op.inputs, *op.outputs)}
    weights = [p for p in case.model.parameters() if p.dim() >= 4]
    assert not [tuple(p.shape) for p in weights if tuple(p.shape) in dims]
    assert len(runs["hwio"]) == len(runs["torch"])
    for ours, theirs in zip(runs["hwio"], runs["torch"]):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    reference = models.autograd_reference(case.model, case.inputs, case.joint())
    assert len(reference) == 1 + len(list(case.model.parameters()))  # loss, gradients
    for ours, theirs in zip(runs["hwio"], reference):
        assert float((ours - theirs).norm() / theirs.norm()) < 1e-2


def test_training_keeps_torch_parameter_shapes(demo):
    case, lowered = demo
    _, _, pte = lowered["hwio"]
    run = training.train_side_by_side(pte, case.model, case.inputs, steps=3, lr=0.1)
    for index, step in enumerate(run.steps):
        gap = abs(step.loss - step.reference_loss)
        assert gap <= 3e-2 * max(1.0, abs(step.reference_loss)), (index, step)
    assert run.update_cosine() >= 0.98, run.update_cosine()
    session = training.TrainingSession(pte, 0.1)
    try:
        session.step(list(case.inputs))
        trained = sorted(tuple(p.shape) for p in case.model.parameters() if p.requires_grad)
        for state in (session.parameters(), session.gradients()):
            assert sorted(tuple(t.shape) for t in state.values()) == trained
    finally:
        session.close()
