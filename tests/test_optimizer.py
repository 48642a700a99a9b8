"""The optimizer inside the program: one ``forward`` call is one training step.

A small convolution + batch norm + linear model in ``train()`` is lowered for V68
(SM8350: every op on executorch's CPU kernels, fp32) with SGD, Adam or AdamW (and a
dynamic loss scale) applied by the program itself (``passes.optimizer``), and
compared with torch eager + ``torch.optim`` (+ ``torch.amp.GradScaler``) step by
step; SGD also with executorch's own SGD (``TrainingSession``) to the bit. On the
HTP simulator (SM8650) the demo network trains with AdamW within the train-mode
bound of torch.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import qnn_convbwd
from qnn_convbwd import training
from qnn_convbwd.passes import optimizer as optimizer_pass
from qnn_convbwd.toolchain import harness

pytestmark = pytest.mark.htp

TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
STEPS = 4


class ConvBnNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        x = torch.relu(self.b1(self.c1(x)))
        return self.fc(torch.relu(self.c2(x)).mean((2, 3)))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return ConvBnNet().train()


def _batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(4, 3, 8, 8, generator=generator),
            torch.randint(0, 10, (4,), generator=generator),
        )
        for _ in range(count)
    ]


def _lower(optimizer=None, loss_scale=None, soc: str = "SM8350") -> training.TrainingProgram:
    module = training.WithLoss(_model(), nn.functional.cross_entropy)
    return training.lower_for_training(
        module,
        _batches(1)[0],
        harness.compile_specs(soc),
        optimizer=optimizer,
        loss_scale=loss_scale,
    )


class TorchRun:
    """torch eager + torch.optim (+ GradScaler) on a copy of the model."""

    def __init__(self, optimizer, loss_scale=None) -> None:
        self.model = copy.deepcopy(_model())
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = optimizer.torch_optimizer(params)
        self.scaler = None
        if loss_scale is not None:
            self.scaler = torch.amp.GradScaler(
                "cpu",
                init_scale=loss_scale.init_scale,
                growth_factor=loss_scale.growth_factor,
                backoff_factor=loss_scale.backoff_factor,
                growth_interval=loss_scale.growth_interval,
            )

    def step(self, x, y) -> float:
        self.optimizer.zero_grad()
        loss = nn.functional.cross_entropy(self.model(x), y)
        if self.scaler is None:
            loss.backward()
            self.optimizer.step()
        else:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        return loss.item()


def _assert_close(ours: dict, theirs: dict, **tolerance) -> None:
    assert set(ours) == set(theirs)
    for name, value in theirs.items():
        if value.dtype.is_floating_point:
            torch.testing.assert_close(ours[name], value, **tolerance, msg=name)
        else:
            assert torch.equal(ours[name], value), name


def _assert_optimizer_state_close(ours: dict, theirs: dict, **tolerance) -> None:
    assert ours["param_groups"] == theirs["param_groups"]
    assert set(ours["state"]) == set(theirs["state"])
    for index, entry in theirs["state"].items():
        assert set(ours["state"][index]) == set(entry), index
        for key, value in entry.items():
            torch.testing.assert_close(
                ours["state"][index][key], value, **tolerance, msg=f"{index}.{key}"
            )


def _assert_optimizer_state_equal(ours: dict, theirs: dict) -> None:
    assert ours["param_groups"] == theirs["param_groups"]
    assert set(ours["state"]) == set(theirs["state"])
    for index, entry in theirs["state"].items():
        for key, value in entry.items():
            assert torch.equal(ours["state"][index][key], value), f"{index}.{key}"


# --- AdamW with a dynamic loss scale -------------------------------------------------

ADAMW = training.AdamW(0.01, weight_decay=0.05)
# Grows every two clean steps, so four steps see it grow twice.
SCALE = training.DynamicLossScale(init_scale=2.0**10, growth_interval=2)


@pytest.fixture(scope="module")
def adamw_program(qnn_sdk) -> training.TrainingProgram:
    program = _lower(ADAMW, SCALE)
    assert harness.delegate_count(program.edge) == 0
    return program


def test_adamw_with_a_loss_scale_follows_torch(adamw_program):
    """Each step's loss, then the parameters, running statistics, optimizer state
    (torch.optim's format) and scale, against torch + AdamW + GradScaler; the
    learning rate changed between steps as a schedule would."""
    session = adamw_program.session()
    reference = TorchRun(ADAMW, SCALE)
    scales = []
    for index, (x, y) in enumerate(_batches(STEPS)):
        if index == 2:
            session.lr = 0.004
            reference.optimizer.param_groups[0]["lr"] = 0.004
        ours, theirs = session.step([x, y]), reference.step(x, y)
        assert math.isclose(ours, theirs, rel_tol=1e-5, abs_tol=1e-6), (index, ours, theirs)
        scales.append(session.loss_scale)
        assert session.loss_scale == reference.scaler.get_scale()
    assert scales == [2.0**10, 2.0**11, 2.0**11, 2.0**12]
    _assert_close(session.state_dict(), reference.model.state_dict(), **TOLERANCE)
    _assert_optimizer_state_close(
        session.optimizer_state_dict(), reference.optimizer.state_dict(), **TOLERANCE
    )
    assert session.scaler_state_dict() == reference.scaler.state_dict()
    session.close()


def test_the_program_alone_runs_the_step(adamw_program):
    """executorch.runtime, with no TrainingModule and no optimizer code: ``forward([x,
    y])`` again and again gives the session's losses, bit for bit."""
    from executorch.runtime import Runtime

    session = adamw_program.session()
    expected = [session.step([x, y]) for x, y in _batches(STEPS)]
    session.close()
    pte = bytes(adamw_program.pte)
    method = Runtime.get().load_program(pte).load_method("forward")
    losses = [float(method.execute([x, y])[0]) for x, y in _batches(STEPS)]
    assert losses == expected
    assert len(set(losses)) == STEPS  # the parameters moved between calls


def test_a_step_with_an_overflow_is_skipped(adamw_program):
    """An input element at infinity makes every gradient non-finite: torch's GradScaler
    skips that step, and the program does too (parameters, optimizer state and step
    count unchanged), backs the scale off, and goes on as torch does. (The forward of
    that step still moves the batch norm's running statistics, in both.)"""
    session = adamw_program.session()
    reference = TorchRun(ADAMW, SCALE)
    batches = _batches(STEPS)
    session.step(list(batches[0]))
    reference.step(*batches[0])
    params = {n: p.clone() for n, p in session.parameters().items()}
    state = session.optimizer_state_dict()
    torch_params = [p.detach().clone() for p in reference.model.parameters()]
    x, y = batches[1]
    x = x.clone()
    x[0, 0, 0, 0] = math.inf
    assert math.isnan(session.step([x, y]))
    assert math.isnan(reference.step(x, y))
    # torch found the overflow: its step was skipped and its scale backed off.
    assert all(torch.equal(a, b) for a, b in zip(torch_params, reference.model.parameters()))
    assert reference.scaler.get_scale() == SCALE.init_scale * SCALE.backoff_factor
    assert session.loss_scale == reference.scaler.get_scale()
    assert all(torch.equal(session.parameters()[n], p) for n, p in params.items())
    _assert_optimizer_state_equal(session.optimizer_state_dict(), state)
    assert session.optimizer_state_dict()["state"][0]["step"] == 1
    for x, y in batches[2:]:
        ours, theirs = session.step([x, y]), reference.step(x, y)
        assert math.isclose(ours, theirs, rel_tol=1e-5, abs_tol=1e-6)
        assert session.loss_scale == reference.scaler.get_scale()
    _assert_close(session.state_dict(), reference.model.state_dict(), equal_nan=True, **TOLERANCE)
    session.close()


def test_resuming_from_the_state_dicts_is_exact(adamw_program):
    """Two steps, the three state dicts into a new session, two more steps: the state
    of four steps straight, to the bit; torch's AdamW loads the same optimizer state."""
    batches = _batches(STEPS)
    straight = adamw_program.session()
    for x, y in batches:
        straight.step([x, y])
    first = adamw_program.session()
    for x, y in batches[:2]:
        first.step([x, y])
    saved = first.state_dict(), first.optimizer_state_dict(), first.scaler_state_dict()
    first.close()
    resumed = adamw_program.session()
    resumed.load_state_dict(saved[0])
    resumed.load_optimizer_state_dict(saved[1])
    resumed.load_scaler_state_dict(saved[2])
    for x, y in batches[2:]:
        resumed.step([x, y])
    _assert_close(resumed.state_dict(), straight.state_dict(), rtol=0, atol=0)
    _assert_optimizer_state_equal(resumed.optimizer_state_dict(), straight.optimizer_state_dict())
    assert resumed.scaler_state_dict() == straight.scaler_state_dict()
    # torch's own AdamW accepts the state.
    model = _model()
    model.load_state_dict(saved[0])
    torch_optimizer = ADAMW.torch_optimizer(list(model.parameters()))
    torch_optimizer.load_state_dict(saved[1])
    straight.close()
    resumed.close()


def test_bad_settings_and_states_are_refused(adamw_program):
    with pytest.raises(TypeError, match="takes no optimizer arguments"):
        adamw_program.session(0.1)
    session = adamw_program.session()
    state = session.optimizer_state_dict()
    state["param_groups"][0]["betas"] = (0.8, 0.999)
    with pytest.raises(training.StateDictError, match="betas"):
        session.load_optimizer_state_dict(state)
    with pytest.raises(training.StateDictError, match="growth_interval"):
        session.load_scaler_state_dict({**session.scaler_state_dict(), "growth_interval": 5})
    session.close()
    with pytest.raises(training.OptimizerError, match="betas"):
        training.AdamW(0.1, betas=(1.5, 0.9))
    with pytest.raises(training.OptimizerError, match="nesterov"):
        training.SGD(0.1, nesterov=True)
    with pytest.raises(TypeError, match="in-program optimizer"):
        _lower(loss_scale=SCALE)
    with qnn_convbwd.enabled(loss_scale=256.0):
        with pytest.raises(training.OptimizerError, match="DynamicLossScale"):
            _lower(ADAMW)


def test_a_program_without_gradients_is_refused():
    from torch.export.graph_signature import OutputKind, OutputSpec

    module = training.WithLoss(_model(), nn.functional.cross_entropy)
    joint = training.export_joint(module, _batches(1)[0])
    specs = joint.graph_signature.output_specs
    specs[:] = [
        OutputSpec(OutputKind.USER_OUTPUT, s.arg, None)
        if s.kind == OutputKind.GRADIENT_TO_PARAMETER
        else s
        for s in specs
    ]
    with pytest.raises(training.OptimizerError, match="no gradient"):
        optimizer_pass.attach(joint, ADAMW)


# --- SGD: torch.optim, and executorch's SGD to the bit ---------------------------------

SGD_CASES = {
    "nesterov": training.SGD(0.05, momentum=0.9, weight_decay=1e-3, nesterov=True),
    "dampening": training.SGD(0.05, momentum=0.9, dampening=0.25, weight_decay=1e-3),
}


@pytest.fixture(scope="module")
def executorch_sgd_program(qnn_sdk) -> training.TrainingProgram:
    """The joint program without an optimizer: executorch's SGD updates it."""
    return _lower()


@pytest.mark.parametrize(
    "case",
    [
        "nesterov",
        pytest.param("dampening", marks=pytest.mark.slow(reason="another SGD lowering")),
    ],
)
def test_sgd_follows_torch_and_equals_executorchs_sgd(case, qnn_sdk, executorch_sgd_program):
    optimizer = SGD_CASES[case]
    program = _lower(optimizer)
    session = program.session()
    theirs = executorch_sgd_program.session(
        optimizer.lr,
        momentum=optimizer.momentum,
        weight_decay=optimizer.weight_decay,
        dampening=optimizer.dampening,
        nesterov=optimizer.nesterov,
    )
    reference = TorchRun(optimizer)
    for x, y in _batches(STEPS):
        loss = session.step([x, y])
        assert loss == theirs.step([x, y])
        assert math.isclose(loss, reference.step(x, y), rel_tol=1e-5, abs_tol=1e-6)
    ours = session.state_dict()
    _assert_close(ours, theirs.state_dict(), rtol=0, atol=0)
    _assert_close(ours, reference.model.state_dict(), **TOLERANCE)
    _assert_optimizer_state_close(
        session.optimizer_state_dict(), reference.optimizer.state_dict(), **TOLERANCE
    )
    session.close()
    theirs.close()


@pytest.mark.slow(reason="one more CPU lowering: Adam's L2 weight decay")
def test_adam_follows_torch(qnn_sdk):
    optimizer = training.Adam(0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01)
    session = _lower(optimizer).session()
    reference = TorchRun(optimizer)
    for x, y in _batches(STEPS):
        assert math.isclose(session.step([x, y]), reference.step(x, y), rel_tol=1e-5)
    _assert_close(session.state_dict(), reference.model.state_dict(), **TOLERANCE)
    _assert_optimizer_state_close(
        session.optimizer_state_dict(), reference.optimizer.state_dict(), **TOLERANCE
    )
    session.close()


# --- on the HTP simulator ---------------------------------------------------------------


def test_adamw_on_the_htp_follows_torch(qnn_sdk):
    """The demo network (adapter + plain, strided and depthwise convolutions, MSE), all
    trainable, lowered for SM8650 with a dynamic loss scale: one delegate computes the
    forward and the backward (the scaled seed comes from the scale buffer alone), the
    AdamW update runs on CPU, no step overflows at the default scale, and every step's
    loss stays within the train-mode bound of torch fp32 + torch.optim.AdamW."""
    from qnn_convbwd.commands import models

    _, model, (x, target) = models.reference_model("demo", trainable_backbone=True)
    optimizer = training.AdamW(0.01)
    program = training.lower_for_training(
        copy.deepcopy(model),
        (x, target),
        harness.compile_specs("SM8650"),
        optimizer=optimizer,
        loss_scale=training.DynamicLossScale(),
    )
    assert harness.delegate_count(program.edge) == 1
    # Every convolution_backward on the HTP; the update's ops on CPU.
    assert program.report.delegated == len(program.report.rows) > 0
    assert any(op.rule == "optimizer_on_cpu" for op in program.report.on_cpu)
    session = program.session()
    reference = copy.deepcopy(model)
    torch_optimizer = optimizer.torch_optimizer(list(reference.parameters()))
    for _ in range(STEPS):
        loss = session.step([x, target])
        torch_optimizer.zero_grad()
        expected = reference(x, target)
        expected.backward()
        torch_optimizer.step()
        assert abs(loss - expected.item()) <= 3e-2 * max(1.0, abs(expected.item()))
    assert session.loss_scale == 2.0**16  # no step skipped
    session.close()


# --- a frozen eval-mode batch norm inside a training model ------------------------------


def _frozen_eval_bn_steps(optimizer, soc: str, affine_trains: bool = False):
    """``_frozen_eval_bn_model`` lowered for ``soc`` with ``optimizer`` in the program and
    stepped ``STEPS`` times beside torch: (model, program, open session, torch's model,
    torch's optimizer, [(program loss, torch loss)] per step)."""
    batches = [(x, y % 4) for x, y in _batches(STEPS)]
    model = _frozen_eval_bn_model(affine_trains=affine_trains)
    program = training.lower_for_training(
        training.WithLoss(copy.deepcopy(model), nn.functional.cross_entropy),
        batches[0],
        harness.compile_specs(soc),
        optimizer=optimizer,
    )
    session = program.session()
    reference = copy.deepcopy(model)
    torch_optimizer = optimizer.torch_optimizer(
        [p for p in reference.parameters() if p.requires_grad]
    )
    losses = []
    for x, y in batches:
        torch_optimizer.zero_grad()
        expected = nn.functional.cross_entropy(reference(x), y)
        expected.backward()
        torch_optimizer.step()
        losses.append((session.step([x, y]), expected.item()))
    return model, program, session, reference, torch_optimizer, losses


def _frozen_eval_bn_model(affine_trains: bool = False) -> nn.Module:
    """A training model whose first convolution is frozen and whose batch norm is in
    eval() (frozen statistics): the linear head trains, and the batch norm's weight and
    bias with ``affine_trains``."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )
    net.train()
    net[1].eval()
    for module in (net[0],) if affine_trains else (net[0], net[1]):
        for p in module.parameters():
            p.requires_grad_(False)
    return net


@pytest.mark.parametrize(
    "case",
    [
        "sgd",
        pytest.param("adamw", marks=pytest.mark.slow(reason="another CPU lowering: AdamW")),
        pytest.param(
            "sgd-affine",
            marks=pytest.mark.slow(
                reason="another CPU lowering; test_train_mode's test_updated_buffers_start_"
                "from_their_own_values checks the emission it relies on"
            ),
        ),
    ],
)
def test_a_frozen_eval_batch_norm_trains_like_torch(case, qnn_sdk):
    """The eval batch norm's lowering folds arithmetic on the frozen buffers it reads
    into constants; the buffers the program writes (the optimizer's step count and
    state, the head's parameters, with ``-affine`` the batch norm's weight and bias)
    stay run-time values and start from the model's: the program lowers, and each
    step's loss, the parameters and the optimizer state follow torch.optim. The SGD
    cases use Nesterov momentum and weight decay, so their update is checked too."""
    optimizer = training.AdamW(0.01) if case == "adamw" else SGD_CASES["nesterov"]
    model, program, session, reference, torch_optimizer, losses = _frozen_eval_bn_steps(
        optimizer, "SM8350", affine_trains=case.endswith("-affine")
    )
    assert harness.delegate_count(program.edge) == 0
    for ours, theirs in losses:
        assert math.isclose(ours, theirs, rel_tol=1e-5, abs_tol=1e-6)
    ours, theirs = session.state_dict(), reference.state_dict()
    # The eval batch norm's step counter is read by no op of the program.
    assert set(theirs) - set(ours) == {"1.num_batches_tracked"}
    _assert_close(ours, {k: v for k, v in theirs.items() if k in ours}, **TOLERANCE)
    trained = ["5.weight", "5.bias"] + (["1.weight", "1.bias"] if "affine" in case else [])
    for name in trained:
        assert not torch.equal(theirs[name], model.state_dict()[name]), name
    _assert_optimizer_state_close(
        session.optimizer_state_dict(), torch_optimizer.state_dict(), **TOLERANCE
    )
    session.close()


@pytest.mark.slow(reason="a simulator lowering and steps of the frozen eval batch norm model")
def test_a_frozen_eval_batch_norm_trains_on_the_htp(qnn_sdk):
    """The same model for SM8650, with SGD and momentum: it lowers, and each step's loss
    stays within the train-mode bound of torch fp32 + torch.optim.SGD."""
    optimizer = training.SGD(0.05, momentum=0.9)
    _, program, session, _, _, losses = _frozen_eval_bn_steps(optimizer, "SM8650")
    assert harness.delegate_count(program.edge) >= 1
    for ours, theirs in losses:
        assert abs(ours - theirs) <= 3e-2 * max(1.0, abs(theirs))
    session.close()
