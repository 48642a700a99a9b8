"""A training program stores its trainable convolution weights in the delegate's
filter layout (``weight_storage="filter"``, ``passes.filter_storage``).

On the joint graph (no lowering): the stored value is the weight permuted, the
program reads it back in torch's layout and returns the gradient permuted, and the
rewritten graph computes the original's numbers exactly; weights read another way
are left alone. On the HTP simulator (SM8650): the same training steps give the same
bits as with the weights stored in torch's layout (``weight_storage="torch"``, where
they are permuted on CPU every step), with no permute left on CPU; a session on the
``.pte`` alone shows parameters, gradients, state and optimizer state in torch's
layout.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.export.graph_signature import OutputKind

import qnn_convbwd
from qnn_convbwd import training
from qnn_convbwd.passes import filter_storage
from qnn_convbwd.toolchain import harness

SOC = "SM8650"
HWIO = (2, 3, 1, 0)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.b1(self.c1(x)))
        return self.fc(torch.relu(self.c2(x)).mean((2, 3)))


class ScaledWeightNet(ConvNet):
    """c2's weight is also read outside its convolution: it must stay in torch's layout."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.b1(self.c1(x)))
        x = nn.functional.conv2d(x, self.c2.weight * 0.5, self.c2.bias, stride=2, padding=1)
        return self.fc(torch.relu(x).mean((2, 3)))


def _net(kind=ConvNet) -> nn.Module:
    torch.manual_seed(0)
    return kind().train()


def _batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(4, 3, 8, 8, generator=generator),
            torch.randint(0, 10, (4,), generator=generator),
        )
        for _ in range(count)
    ]


def _joint(kind=ConvNet) -> torch.export.ExportedProgram:
    module = training.WithLoss(_net(kind), nn.functional.cross_entropy)
    return training.export_joint(module, _batches(1)[0])


def _run(program: torch.export.ExportedProgram, x, y) -> dict[str, torch.Tensor]:
    """Loss and gradients of one call of the joint graph, by target name."""
    signature = program.graph_signature
    state = [program.state_dict[name] for name in signature.parameters] + [
        program.state_dict[name].clone() for name in signature.buffers
    ]
    outputs = program.graph_module(*state, x, y)
    named = {}
    for spec, value in zip(signature.output_specs, outputs):
        if spec.kind == OutputKind.GRADIENT_TO_PARAMETER:
            named[spec.target] = value
        elif spec.kind == OutputKind.LOSS_OUTPUT:
            named["loss"] = value
    return named


def test_stored_weights_compute_the_same_numbers_on_the_joint_graph():
    joint = _joint()
    rewritten, stored = filter_storage.store(joint)
    assert stored == {"net.c1.weight": HWIO, "net.c2.weight": HWIO}
    for name, perm in stored.items():
        assert torch.equal(rewritten.state_dict[name], joint.state_dict[name].permute(perm))
        assert rewritten.state_dict[name].is_contiguous()
    x, y = _batches(1)[0]
    before, after = _run(joint, x, y), _run(rewritten, x, y)
    assert set(before) == set(after)
    for name, value in before.items():
        expected = value.permute(stored[name]) if name in stored else value
        assert torch.equal(after[name], expected), name
    assert joint.state_dict["net.c1.weight"].shape == (8, 3, 3, 3)  # the input is left alone


def test_a_weight_read_outside_its_convolutions_stays_in_torch_layout():
    _, stored = filter_storage.store(_joint(ScaledWeightNet))
    assert stored == {"net.c1.weight": HWIO}


def test_the_layout_map_round_trips_and_refuses_garbage():
    stored = {"net.c1.weight": HWIO, "net.conv3d.weight": (2, 3, 4, 1, 0)}
    assert filter_storage.decode(filter_storage.encode(stored)) == stored
    with pytest.raises(ValueError, match=filter_storage.METHOD):
        filter_storage.decode("[1, 2]")
    with pytest.raises(ValueError, match="no permutation"):
        filter_storage.decode('{"w": [0, 0, 1, 2]}')


def _lower(storage: str, optimizer=None) -> training.TrainingProgram:
    module = training.WithLoss(_net(), nn.functional.cross_entropy)
    with qnn_convbwd.enabled(weight_storage=storage):
        return training.lower_for_training(
            module, _batches(1)[0], harness.compile_specs(SOC), optimizer=optimizer
        )


def _permutes_on_cpu(program: training.TrainingProgram) -> list[str]:
    return [op.node for op in program.report.on_cpu if "permute" in op.op]


@pytest.fixture(scope="module")
def sgd_programs(qnn_sdk) -> dict[str, training.TrainingProgram]:
    return {storage: _lower(storage) for storage in ("filter", "torch")}


def test_filter_storage_steps_to_the_same_bits_with_no_permute_on_cpu(sgd_programs):
    """executorch's SGD with momentum, 3 steps on the simulator: the losses and the whole
    state_dict equal the torch-layout program's to the bit."""
    assert harness.delegate_count(sgd_programs["filter"].edge) == 1
    assert _permutes_on_cpu(sgd_programs["filter"]) == []
    assert len(_permutes_on_cpu(sgd_programs["torch"])) == 4  # 2 weights, 2 gradients
    runs = {}
    for storage, program in sgd_programs.items():
        session = program.session(0.05, momentum=0.9)
        losses = [session.step(list(batch)) for batch in _batches(3)]
        runs[storage] = losses, session.state_dict(), session.gradients()
        session.close()
    assert runs["filter"][0] == runs["torch"][0]
    for index in (1, 2):
        ours, theirs = runs["filter"][index], runs["torch"][index]
        assert set(ours) == set(theirs)
        for name, value in theirs.items():
            assert ours[name].shape == value.shape, name
            assert torch.equal(ours[name], value), name


def test_a_session_on_the_pte_alone_shows_torch_layout(sgd_programs):
    program = sgd_programs["filter"]
    session = training.TrainingSession(program.pte, 0.05)
    try:
        net = _net()
        state = session.state_dict()
        assert {k: tuple(v.shape) for k, v in state.items()} == {
            k: tuple(v.shape) for k, v in net.state_dict().items()
        }
        assert torch.equal(state["c1.weight"], net.c1.weight.detach())
        # The program itself stores it permuted (what a checkpoint of program state holds).
        assert session.program_state()["net.c1.weight"].shape == (3, 3, 3, 8)
        trained = {name for name, _ in net.named_parameters()}
        changed = {k: v + 1 if k in trained else v for k, v in state.items()}
        session.load_state_dict(changed)
        after = session.state_dict()
        for name, value in changed.items():
            assert torch.equal(after[name], value), name
        assert torch.equal(
            session.program_state()["net.c1.weight"], changed["c1.weight"].permute(HWIO)
        )
    finally:
        session.close()


@pytest.mark.slow(reason="two more lowerings with an in-program AdamW (~2 min)")
def test_filter_storage_with_an_in_program_optimizer(qnn_sdk):
    """AdamW inside the program keeps its moments in the stored layout: 3 steps give the
    torch-layout program's losses, state and optimizer state (torch.optim's format) to
    the bit."""
    runs = {}
    for storage in ("filter", "torch"):
        program = _lower(storage, training.AdamW(0.01))
        if storage == "filter":
            assert _permutes_on_cpu(program) == []
        session = program.session()
        losses = [session.step(list(batch)) for batch in _batches(3)]
        runs[storage] = losses, session.state_dict(), session.optimizer_state_dict()
        session.close()
    assert runs["filter"][0] == runs["torch"][0]
    for name, value in runs["torch"][1].items():
        assert torch.equal(runs["filter"][1][name], value), name
    ours, theirs = runs["filter"][2], runs["torch"][2]
    assert ours["param_groups"] == theirs["param_groups"]
    for index, entry in theirs["state"].items():
        for key, value in entry.items():
            assert torch.equal(ours["state"][index][key], value), (index, key)
