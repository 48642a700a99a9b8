"""Train-mode dropout (passes/dropout.py): a counter-based draw on CPU, the masks
applied in the delegate, a fresh mask every step."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import qnn_convbwd
from qnn_convbwd import options
from qnn_convbwd.passes import dropout, train_mode
from qnn_convbwd.training import export_joint

RANDOM_OPS = ("native_dropout", "bernoulli")


# --- models ------------------------------------------------------------------------------


class Head(nn.Module):
    """A linear layer, ``drop``, ReLU, a linear layer, MSE: what the forms differ in is
    only ``drop``."""

    def __init__(self, drop: nn.Module, features: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, features)
        self.drop = drop
        self.fc2 = nn.Linear(features, 4)

    def forward(self, x, target):
        return nn.functional.mse_loss(self.fc2(self.drop(self.fc1(x)).relu()), target)


class FunctionalDropout(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x):
        return nn.functional.dropout(x, self.p, training=True)


class Channels(nn.Module):
    """A 1x1 convolution, ``Dropout2d`` (one draw per channel), pooled to a vector."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 1)
        self.drop = nn.Dropout2d(p)

    def forward(self, x, target):
        y = self.drop(self.conv(x)).mean((2, 3))
        return nn.functional.mse_loss(y, target)


FORMS = {
    "Dropout": lambda p: Head(nn.Dropout(p)),
    "Dropout-inplace": lambda p: Head(nn.Dropout(p, inplace=True)),
    "F.dropout": lambda p: Head(FunctionalDropout(p)),
}


def _inputs(model: nn.Module, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    if isinstance(model, Channels):
        return torch.randn(2, 3, 4, 4, generator=generator), torch.randn(2, 6, generator=generator)
    return torch.randn(4, 8, generator=generator), torch.randn(4, 4, generator=generator)


def _joint(model: nn.Module):
    torch.manual_seed(1)
    model.train()
    inputs = _inputs(model)
    return export_joint(model, inputs), inputs


def _random_ops(program) -> list[str]:
    return [
        n.name
        for n in program.graph.nodes
        if n.op == "call_function" and any(op in str(n.target) for op in RANDOM_OPS)
    ]


class Runner:
    """A joint program run by torch's FX interpreter, its mutated buffers carried from
    one call to the next as executorch's runtime carries them."""

    def __init__(self, program) -> None:
        self.program = program
        self.buffers: dict[str, torch.Tensor] = {}

    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        program, user = self.program, iter(inputs)
        args = []
        for spec in program.graph_signature.input_specs:
            kind = spec.kind.name
            if kind == "USER_INPUT":
                args.append(next(user))
            elif kind in ("PARAMETER", "BUFFER") and spec.target in program.state_dict:
                args.append(self.buffers.get(spec.target, program.state_dict[spec.target]))
            else:
                args.append(program.constants[spec.target])
        outputs = torch.fx.Interpreter(program.graph_module).run(*args)
        kept = []
        for spec, value in zip(program.graph_signature.output_specs, outputs, strict=True):
            if spec.kind.name == "BUFFER_MUTATION":
                self.buffers[spec.target] = value
            else:
                kept.append(value)
        return kept


class Masked(nn.Module):
    """Dropout with a given keep-mask: ``x * mask * scale``."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale
        self.mask: torch.Tensor | None = None

    def forward(self, x):
        return x * self.mask.to(x.dtype) * self.scale


def _eager_step(model: nn.Module, inputs) -> list[torch.Tensor]:
    """Loss and the gradients of the trainable parameters, in ``named_parameters`` order."""
    model.zero_grad(set_to_none=True)
    loss = model(*inputs)
    loss.backward()
    return [loss.detach(), *(p.grad for _, p in model.named_parameters())]


# --- the rewrite -------------------------------------------------------------------------


@pytest.mark.parametrize("form", [*FORMS, "Dropout2d"])
def test_every_form_becomes_a_counter_draw(form):
    """nn.Dropout (native_dropout), inplace=True and Dropout2d (bernoulli.p on an empty
    tensor), F.dropout: no random op is left, one int32 step counter is added as a
    buffer the program mutates, and the caller's program is unchanged."""
    model = Channels(0.3) if form == "Dropout2d" else FORMS[form](0.3)
    program, _ = _joint(model)
    assert _random_ops(program)
    before = len(program.graph.nodes)
    rewritten, sites = dropout.rewrite(program, seed=3)
    assert len(program.graph.nodes) == before and _random_ops(program)
    assert not _random_ops(rewritten)
    assert len(sites) == 1
    expected = (2, 6, 1, 1) if form == "Dropout2d" else (4, 16)
    assert sites[0].shape == expected
    signature = rewritten.graph_signature
    assert signature.buffers_to_mutate and set(signature.buffers_to_mutate.values()) == {
        dropout.STEP_BUFFER
    }
    step = rewritten.state_dict[dropout.STEP_BUFFER]
    assert step.dtype == torch.int32 and step.shape == () and int(step) == 0


@pytest.mark.parametrize(
    "drop", [nn.Dropout(0.4), nn.Dropout(0.4, inplace=True), nn.Dropout2d(0.4)], ids=str
)
def test_training_ir_dropout_is_rewritten(drop):
    """A program straight from ``torch.export`` (training IR: ``aten.dropout``,
    ``dropout_``, ``feature_dropout``), as the stock flow's pre-decomposition hook gets
    it: decomposed, then drawn from the counter; torch with the same mask agrees."""
    model = nn.Sequential(nn.Conv2d(3, 4, 1), drop).train()
    x = torch.randn(2, 3, 4, 4)
    program = torch.export.export(model, (x,), strict=True)
    rewritten, (site,) = dropout.rewrite(program, seed=2)
    assert not _random_ops(rewritten) and not dropout.draw_nodes(rewritten)
    (got,) = Runner(rewritten)(x)
    want = model[0](x) * dropout.site_mask(site, 0) / 0.6
    torch.testing.assert_close(got, want)


def test_eval_mode_is_left_alone():
    """In eval() dropout is absent from the exported graph: nothing to rewrite."""
    model = Head(nn.Dropout(0.5)).eval()
    program = export_joint(model, _inputs(model))
    assert not dropout.draw_nodes(program)
    assert dropout.rewrite(program, seed=1) == (program, [])
    assert train_mode.prepare(program, dropout_seed=1) is program


@pytest.mark.parametrize("form", [*FORMS, "Dropout2d"])
@pytest.mark.parametrize("p", [0.2, 0.5])
def test_rewritten_program_is_torch_with_its_masks(form, p):
    """Three steps of the rewritten joint program (torch, no QNN) against torch eager
    dropping the same elements (``dropout.site_mask`` at the counter's value): loss and
    every gradient, and the masks of successive steps differ."""
    model = Channels(p) if form == "Dropout2d" else FORMS[form](p)
    program, inputs = _joint(model)
    rewritten, (site,) = dropout.rewrite(program, seed=11)
    run = Runner(rewritten)
    reference = copy.deepcopy(model)
    masked = Masked(1.0 / (1.0 - p))
    reference.drop = masked
    masks = []
    for step in range(3):
        masked.mask = dropout.site_mask(site, step)
        masks.append(masked.mask)
        got = run(*inputs)
        want = _eager_step(reference, inputs)
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
        assert int(run.buffers[dropout.STEP_BUFFER]) == step + 1
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])


class ThreeDrops(Head):
    """``Head`` whose ``drop`` sums dropout 0.3, 1 (a constant site: no draw) and 0.6 of
    its input."""

    def __init__(self) -> None:
        super().__init__(nn.ModuleList([nn.Dropout(0.3), nn.Dropout(1.0), nn.Dropout(0.6)]))

    def forward(self, x, target):
        h = self.fc1(x)
        h = sum(drop(h) for drop in self.drop)
        return nn.functional.mse_loss(self.fc2(h.relu()), target)


@pytest.mark.parametrize("form", [*FORMS, "Dropout2d", "three"])
def test_program_masks_make_eager_torch_compute_the_rewritten_program(form):
    """Torch eager under ``ProgramMasks`` (the model itself, no module swapped) computes
    what the rewritten program computes, step after step: its draws take the program's
    sites in forward order, and a site with a constant mask draws on neither side."""
    if form == "three":
        model = ThreeDrops()
    else:
        model = Channels(0.4) if form == "Dropout2d" else FORMS[form](0.4)
    program, inputs = _joint(model)
    rewritten, sites = dropout.rewrite(program, seed=7)
    if form == "three":
        assert [site.keep for site in sites] == pytest.approx([0.7, 0.0, 0.4])
    run = Runner(rewritten)
    reference = copy.deepcopy(model)
    losses = []
    for step in range(3):
        got = run(*inputs)
        with dropout.ProgramMasks(sites, step):
            want = _eager_step(reference, inputs)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
        losses.append(float(want[0]))
    assert len(set(losses)) == 3  # a fresh mask every step


def test_program_masks_refuse_draws_that_do_not_line_up():
    """Sites of another model, or fewer draws than sites, are an error, not a silent
    mismatch."""
    head, channels = FORMS["Dropout"](0.4), Channels(0.4)
    _, head_sites = dropout.rewrite(_joint(head)[0], seed=1)
    _, channel_sites = dropout.rewrite(_joint(channels)[0], seed=1)
    with pytest.raises(ValueError, match="does not match the program's site"):
        with dropout.ProgramMasks(channel_sites, 0):
            head(*_inputs(head))
    with pytest.raises(ValueError, match="drew 1 dropout mask"):
        with dropout.ProgramMasks(head_sites * 2, 0):
            head(*_inputs(head))


class Scaled(nn.Module):
    """``sum(dropout(x * w))``: the gradient of ``w`` is ``x * mask * scale``."""

    def __init__(self, p: float, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(shape))
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return self.drop(x * self.w).sum()


@pytest.mark.parametrize("p", [0.1, 0.5, 0.75])
def test_dropped_elements_get_no_gradient_and_kept_ones_are_scaled_exactly(p):
    shape = (8, 64)
    model = Scaled(p, shape).train()
    x = torch.rand(shape) + 0.5
    program = export_joint(model, (x,))
    rewritten, (site,) = dropout.rewrite(program, seed=5)
    loss, grad = Runner(rewritten)(x)
    kept = dropout.site_mask(site, 0)
    scale = torch.tensor(1.0 / (1.0 - p), dtype=torch.float32)
    assert torch.all(grad[~kept] == 0)
    assert torch.equal(grad[kept], x[kept] * scale)  # fp32 scale, bit for bit
    torch.testing.assert_close(loss, (x * kept * scale).sum())


@pytest.mark.parametrize("p", [0.0, 1.0])
def test_p_zero_and_one_draw_nothing(p):
    """p=0 keeps everything (torch.export leaves no dropout in the graph), p=1 drops
    everything (torch: zeros, no gradient; a constant mask): no counter, the numbers of
    torch eager's own dropout."""
    shape = (4, 16)
    model = Scaled(p, shape).train()
    x = torch.rand(shape)
    program = export_joint(model, (x,))
    rewritten, sites = dropout.rewrite(program, seed=5)
    assert not rewritten.graph_signature.buffers_to_mutate
    assert all(site.key == () for site in sites) and len(sites) == int(p == 1.0)
    loss, grad = Runner(rewritten)(x)
    eager = copy.deepcopy(model)
    want = eager(x)
    want.backward()
    torch.testing.assert_close(loss, want.detach())
    torch.testing.assert_close(grad, eager.w.grad)
    assert torch.all(grad == (1.0 if p == 0.0 else 0.0) * x)


# --- the draw ----------------------------------------------------------------------------


def _binomial_bound(n: int, q: float, sigmas: float = 5.0) -> float:
    return sigmas * math.sqrt(q * (1.0 - q) / n)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_kept_fraction_and_independence_between_steps(p):
    """Over 32768 elements and 4 steps: each mask keeps 1 - p of them within 5 sigma of
    the binomial; two steps agree on (1-p)^2 + p^2 of the elements (independent draws),
    neighbouring elements too."""
    shape = (32, 1024)
    site = dropout.Site("x", shape, 1.0 - p, 1.0 / (1.0 - p), dropout.round_keys(9, 0))
    n = shape[0] * shape[1]
    masks = [dropout.site_mask(site, step).flatten() for step in range(4)]
    agree = (1 - p) ** 2 + p**2
    for step, mask in enumerate(masks):
        kept = mask.float().mean().item()
        assert abs(kept - (1 - p)) < _binomial_bound(n, 1 - p), (step, kept)
        neighbours = (mask[1:] == mask[:-1]).float().mean().item()
        assert abs(neighbours - agree) < _binomial_bound(n, agree)
    for a, b in zip(masks, masks[1:]):
        same = (a == b).float().mean().item()
        assert abs(same - agree) < _binomial_bound(n, agree), same


def test_seed_gives_the_masks_and_sites_draw_apart():
    shape = (16, 64)
    first = dropout.Site("a", shape, 0.5, 2.0, dropout.round_keys(4, 0))
    again = dropout.Site("a", shape, 0.5, 2.0, dropout.round_keys(4, 0))
    other_seed = dropout.Site("a", shape, 0.5, 2.0, dropout.round_keys(5, 0))
    other_site = dropout.Site("b", shape, 0.5, 2.0, dropout.round_keys(4, 1))
    assert torch.equal(dropout.site_mask(first, 7), dropout.site_mask(again, 7))
    assert not torch.equal(dropout.site_mask(first, 7), dropout.site_mask(other_seed, 7))
    assert not torch.equal(dropout.site_mask(first, 7), dropout.site_mask(other_site, 7))


def test_counter_wraps_without_overflow():
    """The counter's last value before it wraps, and 2**30 - 1 elements' worth of index:
    every intermediate of the hash stays a non-negative int32 below 2**31."""
    step = torch.tensor(dropout.STEP_MASK, dtype=torch.int32)
    assert int(dropout.emit_step_update(dropout.eager, step)) == 2**30
    assert int(dropout.emit_step_update(dropout.eager, torch.tensor(2**30, dtype=torch.int32))) == 1
    seen: list[torch.Tensor] = []

    def watched(op, *args, **kwargs):
        value = op(*args, **kwargs)
        if value.dtype == torch.int32:
            seen.append(value)
        return value

    big = dropout.Site("x", (4096,), 0.5, 2.0, dropout.round_keys(1, 0))
    dropout.keep(watched, step, big.shape, big.key, big.keep)
    assert seen and all(int(v.min()) >= 0 for v in seen)
    assert all(int(v.max()) < 2**31 - 1 for v in seen)


# --- the seed option ---------------------------------------------------------------------


def _keys_in_graph(program) -> list[int]:
    return [
        int(n.args[1])
        for n in program.graph.nodes
        if n.op == "call_function" and n.target == torch.ops.aten.bitwise_xor.Scalar
    ]


def _mask_casts(program) -> list[torch.fx.Node]:
    """The casts of a boolean keep-mask to a float dtype."""
    return [
        n
        for n in program.graph.nodes
        if n.op == "call_function"
        and n.target == torch.ops.aten._to_copy.default
        and n.args[0].meta["val"].dtype == torch.bool
    ]


def test_the_backward_reads_the_forward_mask(monkeypatch):
    """The backward's cast and scale of the keep-mask are the forward's nodes: one cast
    and one scaled mask per draw, and the program computes what it computed with its own
    (torch's interpreter, two steps, bit for bit)."""
    program, inputs = _joint(FORMS["Dropout"](0.5))
    shared, _ = dropout.rewrite(program, 3)
    (cast,) = _mask_casts(shared)
    (scaled,) = [u for u in cast.users if u.target == torch.ops.aten.mul.Tensor]
    assert len(scaled.users) == 2  # the forward's product and the backward's
    monkeypatch.setattr(dropout, "share_backward_mask", lambda *args: 0)
    twice, _ = dropout.rewrite(program, 3)
    assert len(_mask_casts(twice)) == 2
    run_shared, run_twice = Runner(shared), Runner(twice)
    for _ in range(2):
        got, want = run_shared(*inputs), run_twice(*inputs)
        assert len(got) == len(want)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def _lowered_head(seed: int):
    from qnn_convbwd import training

    model = FORMS["Dropout"](0.5).train()
    torch.manual_seed(1)
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=0.5)
    inputs = _inputs(model)
    with qnn_convbwd.enabled(dropout_seed=seed):
        program = training.lower_for_training(model, inputs, qnn_convbwd.compile_specs("SM8650"))
    return program, inputs


def _steps(program, inputs, steps: int = 3):
    session = program.session(0.1)
    losses = [session.step(list(inputs)) for _ in range(steps)]
    parameters = {n: p.clone() for n, p in session.parameters().items()}
    session.close()
    return losses, parameters


def test_one_shared_mask_trains_as_two_on_the_simulator(qnn_sdk, monkeypatch):
    """The delegate receives one scaled mask per draw instead of two, and three SGD steps
    on the simulator give the same losses and parameters, bit for bit."""
    from qnn_convbwd_dev import profile

    shared, inputs = _lowered_head(7)
    monkeypatch.setattr(dropout, "share_backward_mask", lambda *args: 0)
    twice, _ = _lowered_head(7)
    masks = [
        [t for t in d.inputs if t.role == "cpu"]
        for p in (shared, twice)
        for d in profile.delegate_io(p.edge)
    ]
    assert [len(m) for m in masks] == [1, 2], masks
    losses, parameters = _steps(shared, inputs)
    want_losses, want_parameters = _steps(twice, inputs)
    assert losses == want_losses and len(set(losses)) == 3
    assert parameters.keys() == want_parameters.keys()
    for name, value in parameters.items():
        assert torch.equal(value, want_parameters[name]), name


def test_dropout_seed_option():
    """``dropout_seed`` keys the draws; None draws the seed from torch's RNG, so
    ``torch.manual_seed`` makes a lowering reproducible."""
    with pytest.raises(ValueError, match="dropout_seed"):
        options.Options(dropout_seed=-1)
    with pytest.raises(ValueError, match="dropout_seed"):
        options.Options(dropout_seed=1.5)
    program, _ = _joint(FORMS["Dropout"](0.5))
    from qnn_convbwd import pipeline

    with qnn_convbwd.enabled(dropout_seed=21):
        keyed = _keys_in_graph(pipeline.prepare_aten(program))
    assert keyed == list(dropout.round_keys(21, 0))
    drawn = []
    for _ in range(2):
        torch.manual_seed(8)
        drawn.append(_keys_in_graph(train_mode.prepare(program)))
    assert drawn[0] == drawn[1]
    torch.manual_seed(9)
    assert _keys_in_graph(train_mode.prepare(program)) != drawn[0]


# --- ExecuTorch's CIFAR model in train() --------------------------------------------------

SEED = 5
# What the draw and the counter are made of, as the lowered program names its CPU ops.
DRAW_OPS = {
    "_to_dim_order_copy",
    "add",
    "arange",
    "bitwise_and",
    "bitwise_right_shift",
    "bitwise_xor",
    "copy_",  # the counter written back to its buffer
    "full",
    "lt",
    "mul",
    "view",
}
# With the default weight_layout="hwio" each trained convolution weight is permuted to
# the filter layout before the delegate and its gradient back after it, on CPU.
WEIGHT_PERMUTE = "permute_copy"


def _assert_on_cpu_the_draw_and_weight_permutes(on_cpu, model: torch.nn.Module) -> None:
    """``on_cpu`` (a Report's): the draw and the counter by ``program_state_on_cpu``,
    and one permute per trained convolution weight and one per its gradient by
    ``weight_layout_on_cpu``."""
    rules = {op.rule for op in on_cpu}
    assert rules == {"program_state_on_cpu", "weight_layout_on_cpu"}, rules
    permutes = [op for op in on_cpu if op.rule == "weight_layout_on_cpu"]
    assert all("permute_copy" in op.op for op in permutes), permutes
    weights = [p for p in model.parameters() if p.requires_grad and p.dim() == 4]
    assert len(permutes) == 2 * len(weights), (len(permutes), len(weights))


def _cifar():
    from executorch.extension.training.examples.CIFAR.model import CIFAR10Model

    from qnn_convbwd_dev import models

    torch.manual_seed(0)
    model = models.CrossEntropyTraining(CIFAR10Model().train())
    generator = torch.Generator().manual_seed(0)
    inputs = (torch.randn(4, 3, 32, 32, generator=generator), torch.randint(0, 10, (4,)))
    return model, inputs


def test_cifar_train_decides_one_delegate_with_the_draw_on_cpu(qnn_sdk):
    """The verdicts (no compile): every op kept on CPU is the draw or the counter, by
    ``program_state_on_cpu``, or a trained weight's permute, by ``weight_layout_on_cpu``;
    the forward max pools go to the HTP with their indices."""
    from qnn_convbwd import api
    from qnn_convbwd.toolchain import harness

    model, inputs = _cifar()
    report = api.decide(export_joint(model, inputs), harness.compile_specs("SM8650"))
    assert report.on_cpu
    _assert_on_cpu_the_draw_and_weight_permutes(report.on_cpu, model)
    assert not any("max_pool" in op.op or "dropout" in op.op for op in report.on_cpu)


@pytest.fixture(scope="module")
def cifar_lowered(qnn_sdk):
    """CIFAR10Model().train() with cross-entropy, lowered for SM8650 with a fixed seed:
    (model, inputs, the draw's Site, compiled)."""
    from qnn_convbwd.toolchain import harness

    model, inputs = _cifar()
    program = export_joint(model, inputs)
    _, (site,) = dropout.rewrite(program, SEED)
    with qnn_convbwd.enabled(dropout_seed=SEED):
        compiled = harness.lower_program(program, "SM8650")
    return model, inputs, site, compiled


def test_cifar_train_is_one_delegate(cifar_lowered):
    """Dropout does not split the graph: one delegate with the three max pools (and
    their indices) and their backwards; on CPU only the draw, its counter and the
    trained weights' permutes."""
    from qnn_convbwd.commands.train_cli import cpu_ops
    from qnn_convbwd.toolchain import harness

    model, _, _, compiled = cifar_lowered
    assert harness.delegate_count(compiled.edge) == 1
    assert set(cpu_ops(compiled.edge)) <= DRAW_OPS | {WEIGHT_PERMUTE}, cpu_ops(compiled.edge)
    _assert_on_cpu_the_draw_and_weight_permutes(compiled.report.on_cpu, model)
    graph = compiled.edge.exported_program().graph
    assert not [n for n in graph.nodes if "max_pool" in str(n.target)]
    assert all(row.delegated for row in compiled.report.rows)


def _train_side_by_side(cifar_lowered, steps: int, lr: float = 0.05):
    """``steps`` SGD steps on the simulator and in torch eager dropping the elements the
    program drew (its masks, recomputed from the seed and the step)."""
    from qnn_convbwd.training import TrainingSession

    model, inputs, site, compiled = cifar_lowered
    reference = copy.deepcopy(model)
    masked = Masked(site.scale)
    reference.classifier.classifier[2] = masked
    optimizer = torch.optim.SGD(reference.parameters(), lr=lr)
    session = TrainingSession(compiled.pte, lr)
    losses, reference_losses = [], []
    try:
        for step in range(steps):
            losses.append(session.step(list(inputs)))
            masked.mask = dropout.site_mask(site, step)
            optimizer.zero_grad(set_to_none=True)
            loss = reference(*inputs)
            loss.backward()
            optimizer.step()
            reference_losses.append(float(loss.detach()))
        parameters = {n: p.detach().clone() for n, p in session.parameters().items()}
    finally:
        session.close()
    return losses, reference_losses, parameters, dict(reference.named_parameters())


def _check_run(losses, reference_losses, parameters, reference_parameters):
    assert all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < losses[0]
    for got, want in zip(losses, reference_losses, strict=True):
        assert abs(got - want) <= 5e-3 * max(1.0, abs(want)), (losses, reference_losses)
    for name, want in reference_parameters.items():
        error = float((parameters[name] - want.detach()).norm() / want.detach().norm())
        assert error < 1e-2, (name, error)


def test_cifar_train_steps_follow_torch_with_the_programs_masks(cifar_lowered):
    """Three SGD steps through TrainingSession on the simulator (a fresh mask each step)
    follow torch eager with the same masks: losses and the parameters after them."""
    _check_run(*_train_side_by_side(cifar_lowered, 3))


@pytest.mark.slow(reason="12 simulator training steps of the CIFAR model with dropout")
def test_cifar_train_longer_run(cifar_lowered):
    _check_run(*_train_side_by_side(cifar_lowered, 12))
