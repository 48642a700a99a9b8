"""A training session's state: ``state_dict`` / ``load_state_dict``, resume, SGD options.

A small convolution + batch norm model in ``train()`` (running statistics are
buffers the program updates; the stem convolution is frozen, so its values are
constants baked into the program) is lowered once for V68 (SM8350: everything on
executorch's CPU kernels, fp32) and once for the HTP simulator (SM8650), and
compared with torch eager + ``torch.optim.SGD``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from qnn_convbwd import training
from qnn_convbwd.toolchain import harness

pytestmark = pytest.mark.htp

LR = 0.1


class FrozenStemConvBn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.c1, self.b1 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 10)
        self.stem.requires_grad_(False)

    def forward(self, x):
        x = torch.relu(self.b1(self.c1(torch.relu(self.stem(x)))))
        x = torch.relu(self.b2(self.c2(x)))
        return self.fc(x.mean((2, 3)))


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = FrozenStemConvBn().train()
    with torch.no_grad():  # statistics other than (0, 1, 0): the program must start from them
        for bn in (model.b1, model.b2):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            bn.num_batches_tracked.fill_(3)
    return model


def _batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(4, 3, 8, 8, generator=generator) * 2 + 0.5, torch.randint(0, 10, (4,)))
        for _ in range(count)
    ]


def _lower(soc: str) -> training.TrainingProgram:
    model = _model()
    x, y = _batches(1)[0]
    module = training.WithLoss(copy.deepcopy(model), nn.functional.cross_entropy)
    return training.lower_for_training(module, (x, y), harness.compile_specs(soc))


@pytest.fixture(scope="module")
def cpu_program(qnn_sdk) -> training.TrainingProgram:
    program = _lower("SM8350")
    assert harness.delegate_count(program.edge) == 0
    return program


@pytest.fixture(scope="module")
def htp_program(qnn_sdk) -> training.TrainingProgram:
    program = _lower("SM8650")
    assert harness.delegate_count(program.edge) == 1
    return program


def _torch_steps(model: nn.Module, batches, **sgd) -> tuple[nn.Module, list[float]]:
    model = copy.deepcopy(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=LR, **sgd)
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model, losses


def _assert_state_close(ours: dict, theirs: dict, rtol: float, atol: float) -> None:
    assert list(ours) == list(theirs) or set(ours) == set(theirs)
    for name, value in theirs.items():
        if value.dtype.is_floating_point:
            torch.testing.assert_close(ours[name], value, rtol=rtol, atol=atol, msg=name)
        else:
            assert torch.equal(ours[name], value), (name, ours[name], value)


def test_fresh_state_is_the_eager_models_and_loads_strictly(cpu_program):
    model = _model()
    session = cpu_program.session(LR)
    state = session.state_dict()
    assert set(state) == set(model.state_dict())
    _assert_state_close(state, model.state_dict(), rtol=0, atol=0)
    # Frozen stem: a constant of the program; running statistics: buffers it updates.
    assert set(cpu_program.layout.constants) == {"stem.weight", "stem.bias"}
    assert set(session.buffers()) == {
        f"net.{bn}.{stat}"
        for bn in ("b1", "b2")
        for stat in ("running_mean", "running_var", "num_batches_tracked")
    }
    eager = FrozenStemConvBn()
    eager.load_state_dict(state, strict=True)
    x, y = _batches(1)[0]
    with pytest.raises(ValueError, match="1 inputs given, the program takes 2"):
        session.step([x])
    with pytest.raises(ValueError, match=r"input 1: shape \(3,\), the program takes \(4,\)"):
        session.step([x, y[:3]])
    session.close()


SGD_OPTIONS = {
    "plain": {},
    "momentum_dampening": {"momentum": 0.9, "dampening": 0.3},
    "nesterov_weight_decay": {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
}


@pytest.mark.parametrize("options", sorted(SGD_OPTIONS))
def test_cpu_steps_match_torch_sgd(cpu_program, options):
    """fp32 on CPU: losses, parameters and running statistics after 3 steps equal torch
    eager's with the same SGD options."""
    batches = _batches(3)
    reference, reference_losses = _torch_steps(_model(), batches, **SGD_OPTIONS[options])
    session = cpu_program.session(LR, **SGD_OPTIONS[options])
    losses = [session.step(batch) for batch in batches]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference_losses))
    _assert_state_close(session.state_dict(), reference.state_dict(), rtol=1e-4, atol=1e-5)
    eager = FrozenStemConvBn()
    eager.load_state_dict(session.state_dict(), strict=True)
    _assert_state_close(eager.state_dict(), reference.state_dict(), rtol=1e-4, atol=1e-5)
    session.close()


def _resume_matches_straight_run(program: training.TrainingProgram, **sgd) -> None:
    batches = _batches(4)
    straight = program.session(LR, **sgd)
    for batch in batches:
        straight.step(batch)
    first = program.session(LR, **sgd)
    for batch in batches[:2]:
        first.step(batch)
    saved = first.state_dict()
    first.close()
    resumed = program.session(LR, **sgd)
    resumed.load_state_dict(saved)
    for batch in batches[2:]:
        resumed.step(batch)
    _assert_state_close(resumed.state_dict(), straight.state_dict(), rtol=0, atol=1e-6)
    # And it moved: the resumed state is not the saved one.
    assert not torch.equal(resumed.state_dict()["c2.weight"], saved["c2.weight"])
    assert int(resumed.buffers()["net.b1.num_batches_tracked"]) == 3 + 4
    straight.close()
    resumed.close()


def test_cpu_resume_equals_a_straight_run(cpu_program):
    _resume_matches_straight_run(cpu_program)


def _program_state_round_trip(program: training.TrainingProgram, session_of) -> None:
    """Two steps, ``program_state()`` into a new session, two more steps: every tensor the
    program keeps equals four steps straight, to the bit; ``load_program_state`` refuses
    a state without one of its tensors and writes nothing then."""
    batches = _batches(4)
    straight = session_of(program)
    for batch in batches:
        straight.step(batch)
    first = session_of(program)
    for batch in batches[:2]:
        first.step(batch)
    saved = first.program_state()
    first.close()
    # The buffers the .pte lists (with an in-program optimizer: every tensor it keeps).
    assert set(training.program_buffers(program.pte)) <= set(saved)
    resumed = session_of(program)
    fresh = resumed.program_state()
    partial = {k: v for k, v in saved.items() if k != "net.b1.running_mean"}
    with pytest.raises(training.StateDictError, match=r"missing \['net.b1.running_mean'\]"):
        resumed.load_program_state(partial)
    assert all(torch.equal(resumed.program_state()[k], v) for k, v in fresh.items())
    resumed.load_program_state(saved)
    for batch in batches[2:]:
        resumed.step(batch)
    ours, theirs = resumed.program_state(), straight.program_state()
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[k], v) for k, v in theirs.items()), [
        k for k, v in theirs.items() if not torch.equal(ours[k], v)
    ]
    straight.close()
    resumed.close()


def test_program_state_resumes_executorchs_sgd_to_the_bit(cpu_program):
    _program_state_round_trip(cpu_program, lambda program: program.session(LR))


def test_program_state_resumes_an_in_program_optimizer_to_the_bit(qnn_sdk):
    """With SGD inside the program the state holds its momentum, step count and learning
    rate too."""
    module = training.WithLoss(_model(), nn.functional.cross_entropy)
    program = training.lower_for_training(
        module,
        _batches(1)[0],
        harness.compile_specs("SM8350"),
        optimizer=training.SGD(LR, momentum=0.9),
    )
    _program_state_round_trip(program, lambda program: program.session())
    session = program.session()
    assert set(session.program_state()) == set(training.program_buffers(program.pte))
    assert "qnn_convbwd_optim_0_momentum_buffer" in session.program_state()
    assert session.layout.prefix == "net."
    session.close()


def test_htp_resume_equals_a_straight_run(htp_program):
    _resume_matches_straight_run(htp_program)


def test_htp_steps_track_torch(htp_program):
    """The HTP computes in fp16: after 3 steps with momentum the state is torch's to
    fp16-level tolerance, the whole update points where torch's does, and the
    statistics are counted exactly. (A bias followed by a batch norm has a zero
    gradient in exact arithmetic: its update is rounding noise on both sides, so
    values are compared, not per-tensor update directions.)"""
    batches = _batches(3)
    initial = _model().state_dict()
    reference, reference_losses = _torch_steps(_model(), batches, momentum=0.9)
    session = htp_program.session(LR, momentum=0.9)
    losses = [session.step(batch) for batch in batches]
    for ours, theirs in zip(losses, reference_losses):
        assert abs(ours - theirs) <= 3e-2 * max(1.0, abs(theirs)), (losses, reference_losses)
    state, expected = session.state_dict(), reference.state_dict()
    for name, value in expected.items():
        if value.dtype.is_floating_point:
            torch.testing.assert_close(state[name], value, rtol=1e-2, atol=1e-3, msg=name)
        else:
            assert torch.equal(state[name], value), name
    trainable = [n for n, p in reference.named_parameters() if p.requires_grad]
    ours = torch.cat([(state[n] - initial[n]).flatten() for n in trainable])
    theirs = torch.cat([(expected[n] - initial[n]).flatten() for n in trainable])
    assert float(nn.functional.cosine_similarity(ours, theirs, dim=0)) >= 0.99
    session.close()


def test_htp_loaded_state_reaches_the_delegate(htp_program):
    """Parameters loaded into a fresh session are the ones the delegate computes with,
    and loaded running statistics are the ones the next update starts from."""
    batches = _batches(4)
    trained, _ = _torch_steps(_model(), batches[:3], momentum=0.9)
    with torch.no_grad():
        for bn in (trained.b1, trained.b2):
            bn.running_mean.add_(1.0)
            bn.num_batches_tracked.fill_(11)
    session = htp_program.session(LR)
    untouched = htp_program.session(LR)
    session.load_state_dict(trained.state_dict())
    x, y = batches[3]
    after, expected = _torch_steps(trained, [(x, y)])
    fresh_loss = untouched.step((x, y))
    loss = session.step((x, y))
    assert abs(loss - expected[0]) <= 3e-2 * max(1.0, abs(expected[0])), (loss, expected)
    assert abs(loss - fresh_loss) > 10 * abs(loss - expected[0]), (loss, fresh_loss, expected)
    buffers = session.buffers()
    for bn in ("b1", "b2"):
        ours = buffers[f"net.{bn}.running_mean"]
        theirs = after.get_buffer(f"{bn}.running_mean")
        assert float((ours - theirs).norm() / theirs.norm()) <= 1e-2, bn
        assert int(buffers[f"net.{bn}.num_batches_tracked"]) == 12
    session.close()
    untouched.close()


def test_bad_state_dicts_name_what_is_wrong(cpu_program):
    session = cpu_program.session(LR)
    good = session.state_dict()
    with pytest.raises(training.StateDictError, match=r"unexpected.*'head\.weight'"):
        session.load_state_dict({**good, "head.weight": torch.zeros(1)})
    partial = {k: v for k, v in good.items() if k != "b1.running_var"}
    with pytest.raises(training.StateDictError, match=r"missing: \['b1\.running_var'\]"):
        session.load_state_dict(partial)
    with pytest.raises(training.StateDictError, match=r"fc\.weight: \(8, 10\) in the state"):
        session.load_state_dict({**good, "fc.weight": torch.zeros(8, 10)})
    with pytest.raises(training.StateDictError, match=r"baked into the program.*'stem\.weight'"):
        session.load_state_dict({**good, "stem.weight": good["stem.weight"] + 1})
    # Nothing was written by the failed loads: the state is as it was.
    changed = {**good, "fc.weight": good["fc.weight"] + 1, "stem.weight": good["stem.weight"] + 1}
    with pytest.raises(training.StateDictError):
        session.load_state_dict(changed)
    _assert_state_close(session.state_dict(), good, rtol=0, atol=0)
    # Not strict: missing names keep their values, unknown names are ignored.
    session.load_state_dict({"fc.bias": good["fc.bias"] + 1, "other": torch.ones(2)}, strict=False)
    torch.testing.assert_close(session.state_dict()["fc.bias"], good["fc.bias"] + 1)
    session.close()


def test_session_from_bytes_alone(cpu_program):
    """Without a layout the names lose the prefix they all share; constants are unknown
    to the session, so its state holds what the program trains and updates."""
    session = training.TrainingSession(cpu_program.pte, LR)
    state = session.state_dict()
    assert set(state) == set(_model().state_dict()) - {"stem.weight", "stem.bias"}
    with pytest.raises(training.StateDictError, match="stem.weight"):
        session.load_state_dict(_model().state_dict())
    session.load_state_dict(_model().state_dict(), strict=False)
    session.close()


@pytest.mark.slow(reason="a second HTP lowering (external weights); test_training checks a .ptd")
def test_external_weights_session_keeps_its_state(qnn_sdk):
    """Parameters and constants in a .ptd beside the program: the session trains from it,
    updated buffers are still found by name, and a new session resumes from its state."""
    model = _model()
    batches = _batches(3)
    module = training.WithLoss(copy.deepcopy(model), nn.functional.cross_entropy)
    program = training.lower_for_training(
        module, batches[0], harness.compile_specs("SM8650"), external_weights=True
    )
    assert program.ptd
    reference, _ = _torch_steps(model, batches)
    session = program.session(LR)
    for batch in batches:
        session.step(batch)
    assert set(session.buffers()) == {f"net.{n}" for n, _ in model.named_buffers()}
    state = session.state_dict()
    _assert_state_close(state, reference.state_dict(), rtol=1e-2, atol=1e-3)
    resumed = program.session(LR)
    resumed.load_state_dict(state)
    _assert_state_close(resumed.state_dict(), state, rtol=0, atol=0)
    session.close()
    resumed.close()


class WithDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.drop, self.fc = nn.Dropout(0.5), nn.Linear(8, 10)

    def forward(self, x):
        return self.fc(self.drop(torch.relu(self.b(self.c(x))).mean((2, 3))))


def test_dropout_step_counter_is_not_in_the_state_dict(qnn_sdk):
    """The program's dropout step counter is the plugin's state, not the module's: the
    eager model loads the session's state strictly, after steps as before them."""
    torch.manual_seed(0)
    model = WithDropout().train()
    x, y = _batches(1)[0]
    module = training.WithLoss(copy.deepcopy(model), nn.functional.cross_entropy)
    program = training.lower_for_training(module, (x, y), harness.compile_specs("SM8350"))
    session = program.session(LR)
    assert any(name.startswith(training.PLUGIN_BUFFER_PREFIX) for name in session.buffers())
    session.step([x, y])
    state = session.state_dict()
    assert set(state) == set(model.state_dict())
    model.load_state_dict(state)
    session.load_state_dict(state)
    session.close()
