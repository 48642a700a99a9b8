"""Which ops of torchvision's classifiers stay on CPU when they train in ``train()``.

For each architecture and fine-tuning scheme (``finetune.apply_scheme``: ``full``,
``last-layers``, ``bias-only``) the model is put in ``train()`` (batch statistics,
running statistics updated; dropout modules in ``eval()``, since torch and the
program draw different masks, and with ``steps`` torchvision's stochastic depth as
well), wrapped with cross-entropy and exported as its joint
training graph (``training.export_joint``). Then, per model:

* by default ``qnn_convbwd.decide`` (the rules alone, nothing compiled): cheap;
* with ``lower=True`` a real lowering (``training.lower_for_training``): the
  delegate count and the lowering time; with ``steps=N`` also N plain SGD steps on
  the simulator through ``TrainingSession`` (each loss, and the first step's
  gradients) next to torch's fp32 and fp16 steps from the same weights.

Every op kept on CPU is counted by rule and op, in three kinds (``kind``):

* ``state``: on CPU by design: the program's state (running statistics' updates, a
  step counter), trainable weights moved between torch's layout and the delegate's,
  an in-program optimizer, the loss scale's division (fp32, exact);
* ``follows``: on CPU because another op is (a constant whose consumer stays, a
  getitem of a producer on CPU, a node prepared for a CPU op);
* ``gap``: anything else, an op the HTP path does not take yet: what to work on.

``markdown(rows)`` is the table of docs/results.md; ``rows`` go to JSON as they are.
``scripts/zoo_sweep.py`` is the command.

How much one fp16 rounding can move a step's loss, in torch alone (nothing lowered):
``loss_spread`` takes torch's steps with the batch, activations, gradients or updated
weights moved by one fp16 rounding per element, ``step_noise`` sets torch fp32's
spread over the batch's neighbours beside torch fp16's gaps and the one-draw and
multi-draw bounds (``step_floor``); ``zoo_sweep.py --noise K`` prints it.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import json
import logging
import statistics
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

# torchvision classification CNNs the sweep knows, small to large.
MODELS = (
    "resnet18",
    "regnet_y_400mf",
    "mobilenet_v3_large",
    "mnasnet0_5",
    "squeezenet1_1",
    "shufflenet_v2_x0_5",
    "efficientnet_b0",
    "googlenet",
    "densenet121",
    "vgg11_bn",
    "efficientnet_v2_s",
    "resnext50_32x4d",
    "convnext_tiny",
)
SCHEMES = ("full", "last-layers", "bias-only")
# Constructor arguments beyond num_classes: GoogLeNet's auxiliary heads return a tuple
# in train() that a plain cross-entropy cannot take.
_EXTRA_ARGUMENTS: dict[str, dict[str, Any]] = {"googlenet": {"aux_logits": False}}
# Sizes tried, in order, for the smallest input a model takes.
_SIZES = (32, 48, 64, 96, 128, 160, 224)

STATE = "state"
FOLLOWS = "follows"
GAP = "gap"
KINDS = (STATE, FOLLOWS, GAP)
# Rules that keep an op on CPU by design, and rules that keep one there because another is.
STATE_RULES = frozenset(
    {"program_state_on_cpu", "weight_layout_on_cpu", "optimizer_on_cpu", "loss_unscale"}
)
FOLLOWS_RULES = frozenset(
    {
        "constant_follows_consumers",
        "follows_its_producer",
        "lifted_for_cpu",
        "weight_view_follows_convolutions",
        "indices_cast_follows_its_pool",
    }
)


def kind(rule: str) -> str:
    """``state``, ``follows`` or ``gap`` for an op kept on CPU by ``rule``."""
    if rule in STATE_RULES:
        return STATE
    if rule in FOLLOWS_RULES:
        return FOLLOWS
    return GAP


def architecture(arch: str, classes: int = 10, seed: int = 0) -> nn.Module:
    """torchvision's ``arch`` with random weights from ``seed`` (the global random state is
    left as it was), with the constructor arguments the sweep needs (``_EXTRA_ARGUMENTS``)."""
    from qnn_convbwd.torchvision_import import import_torchvision

    models = import_torchvision().models
    if arch not in models.list_models(module=models):
        raise ValueError(f"unknown torchvision classifier {arch!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return models.get_model(
            arch, weights=None, num_classes=classes, **_EXTRA_ARGUMENTS.get(arch, {})
        )


def smallest_size(arch: str, at_least: int = 32) -> int:
    """The smallest of ``_SIZES`` (from ``at_least`` on) whose square input ``arch`` takes."""
    from qnn_convbwd import finetune

    net = architecture(arch)
    for size in (s for s in _SIZES if s >= at_least):
        try:
            finetune.check_size(net, size)
        except finetune.ModelError:
            continue
        return size
    raise ValueError(f"{arch} takes none of the sizes {_SIZES} from {at_least} on")


def train_mode_batch(
    arch: str, scheme: str, batch: int, size: int, seed: int = 0, stochastic_depth: bool = True
) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """``arch`` in ``train()`` with ``scheme`` applied (``full``: every parameter trains,
    as a fresh model's do) and dropout modules in ``eval()``, and one seeded batch of
    random images and labels (10 classes). ``stochastic_depth=False``: torchvision's
    ``StochasticDepth`` in ``eval()`` too, for steps compared with torch's (torch and the
    program draw their own masks)."""
    from qnn_convbwd import finetune

    net = architecture(arch, 10, seed).train()
    if scheme != "full":  # finetune's schemes need a linear head, which SqueezeNet lacks
        net = finetune.apply_scheme(net, scheme, size=size)
    for module in net.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) or (
            not stochastic_depth and _stochastic_depth(module)
        ):
            module.eval()
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, size, size, generator=generator)
    y = torch.randint(0, 10, (batch,), generator=generator)
    return net, x, y


def _stochastic_depth(module: nn.Module) -> bool:
    return type(module).__name__ == "StochasticDepth"


@dataclasses.dataclass
class Row:
    """One model and scheme: what stays on CPU, and what lowering it took."""

    arch: str
    scheme: str
    size: int
    batch: int
    soc: str
    how: str  # "decide" or "lower"
    export_seconds: float
    seconds: float  # decide() or lower_for_training's lowering time
    # "rule op" -> count, per kind
    on_cpu: dict[str, dict[str, int]]
    delegates: int | None = None  # lower only
    step: dict[str, Any] | None = None  # lower with step only
    error: str | None = None  # the model could not be swept: why

    def count(self, which: str) -> int:
        return sum(self.on_cpu.get(which, {}).values())


def count_on_cpu(on_cpu: Iterable[Any]) -> dict[str, dict[str, int]]:
    """``Report.on_cpu`` as ``{kind: {"rule op": count}}`` (every kind present)."""
    counted: dict[str, collections.Counter] = {k: collections.Counter() for k in KINDS}
    for op in on_cpu:
        counted[kind(op.rule)][f"{op.rule} {op.op}"] += 1
    return {k: dict(sorted(c.items())) for k, c in counted.items()}


def _torch_steps(
    net: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    steps: int,
    lr: float,
    dtype: torch.dtype,
    perturbation: _Perturbation | None = None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """torch's losses over ``steps`` plain SGD steps of a copy of ``net`` in ``dtype`` on the
    batch ``(x, y)``, and the first step's gradients (fp32 copies). ``perturbation`` (see
    ``loss_spread``), in every step before the last, moves activations, gradients or the
    updated weights, or hands the update a neighbour's gradients."""
    model = copy.deepcopy(net).to(dtype)
    hooks = perturbation.install(model) if perturbation is not None else []
    losses: list[float] = []
    first: dict[str, torch.Tensor] = {}
    for index in range(steps):
        last = index == steps - 1
        if last:
            for hook in hooks:
                hook.remove()
        if perturbation is not None and not last:
            perturbation.before_step(model, y)
        model.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x.to(dtype)).float(), y)
        loss.backward()
        losses.append(float(loss.detach()))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.grad is None:
                    continue
                if index == 0:
                    first[name] = p.grad.float().clone()
                grad = p.grad
                if perturbation is not None and not last:
                    grad = perturbation.gradient(name, grad)
                p.add_(grad, alpha=-lr)
                if perturbation is not None and not last:
                    p.copy_(perturbation.weight(name, p))
    return losses, first


# What ``loss_spread`` moves by a relative ``size`` per element, and what it takes from
# a neighbour of the batch.
PERTURBATIONS = ("inputs", "activations", "gradients", "weights", "neighbour_gradients")


@dataclasses.dataclass
class _Perturbation:
    """Every element of one kind of tensor times ``1 + u * size``, ``u`` uniform on
    [-1, 1] from ``generator``; activations are the outputs of the modules ``only`` names,
    gradients and weights those of the parameters whose names start with one of ``only``
    (all without ``only``). ``neighbour_gradients``: those gradients are the ones the model
    has on ``neighbour`` (a moved batch) instead."""

    how: str
    size: float
    only: tuple[str, ...]
    generator: torch.Generator
    neighbour: torch.Tensor | None = None
    _theirs: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    def before_step(self, model: nn.Module, y: torch.Tensor) -> None:
        """The gradients of a copy of ``model`` on ``neighbour`` (its running statistics
        untouched), for ``gradient`` to hand out."""
        if self.how != "neighbour_gradients":
            return
        if self.neighbour is None:
            raise ValueError("neighbour_gradients need the neighbour batch")
        twin = copy.deepcopy(model)
        twin.zero_grad(set_to_none=True)
        dtype = next(twin.parameters()).dtype
        nn.functional.cross_entropy(twin(self.neighbour.to(dtype)).float(), y).backward()
        self._theirs = {n: p.grad for n, p in twin.named_parameters() if p.grad is not None}

    def _moved(self, t: torch.Tensor) -> torch.Tensor:
        u = torch.rand(t.shape, generator=self.generator, dtype=torch.float32) * 2 - 1
        return (t.float() * (1 + u * self.size)).to(t.dtype)

    def _chosen(self, name: str) -> bool:
        return not self.only or any(name == o or name.startswith(o + ".") for o in self.only)

    def install(self, model: nn.Module) -> list[Any]:
        if self.how != "activations":
            return []
        modules = dict(model.named_modules())
        return [
            modules[name].register_forward_hook(lambda _m, _i, out: self._moved(out))
            for name in self.only
        ]

    def gradient(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        if not self._chosen(name):
            return grad
        if self.how == "neighbour_gradients":
            return self._theirs[name]
        return self._moved(grad) if self.how == "gradients" else grad

    def weight(self, name: str, p: torch.Tensor) -> torch.Tensor:
        return self._moved(p) if self.how == "weights" and self._chosen(name) else p


@dataclasses.dataclass(frozen=True)
class Spread:
    """torch's SGD losses, unperturbed (``reference``, one per step) and under ``len(draws)``
    perturbations of kind ``how`` (``draws[k][step]``)."""

    how: str
    reference: list[float]
    draws: list[list[float]]

    def losses(self, step: int) -> list[float]:
        """Step ``step``'s loss (0 the first), unperturbed first, then each draw's."""
        return [self.reference[step], *(d[step] for d in self.draws)]

    def deviations(self, step: int) -> list[float]:
        """Each draw's ``|loss - unperturbed loss|`` at step ``step``."""
        return [abs(d[step] - self.reference[step]) for d in self.draws]

    def median(self, step: int) -> float:
        return statistics.median(self.deviations(step))

    def maximum(self, step: int) -> float:
        return max(self.deviations(step))


def loss_spread(
    net: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    how: str = "inputs",
    *,
    steps: int = 2,
    lr: float = 0.01,
    draws: int = 8,
    seed: int = 0,
    only: Sequence[str] = (),
    size: float = 2.0**-11,
    dtype: torch.dtype = torch.float32,
) -> Spread:
    """torch's losses over ``steps`` SGD steps (as the sweep's reference, ``_torch_steps``)
    from ``net`` on ``(x, y)``, unperturbed and under ``draws`` seeded perturbations of
    one fp16 rounding's size (``size``, relative, per element):

    * ``inputs``: the batch is ``fidelity.neighbours(x, draws + 1, seed)``'s draws (every
      step takes it; with ``size`` other than fp16's rounding the same, scaled);
    * ``activations``: in every step before the last, the outputs of the modules named in
      ``only`` (at least one);
    * ``gradients``: in every step before the last, the gradients (of the parameters
      whose names start with one of ``only``, all without it) before the update;
    * ``weights``: the same parameters after each update but the last's;
    * ``neighbour_gradients``: in every step before the last, the gradients of the same
      parameters are the ones torch has on the draw's neighbour of the batch (as
      ``inputs``' draws), the rest of the step (its forward, the running statistics) on
      the batch itself: which parameters' updates carry the last loss's move.

    How far the last step's loss moves says how much one fp16-sized difference in the
    steps before it can move that loss: a program that differs from torch fp32 by fp16's
    roundings is one such draw. The steps run on torch's pinned kernels
    (``reference_kernels``: one thread; oneDNN as a fresh process has it in fp32, off in
    fp16), so their numbers do not depend on the host's cores or on an earlier lowering.
    """
    from qnn_convbwd_dev import reference_kernels

    if how not in PERTURBATIONS:
        raise ValueError(f"unknown perturbation {how!r}: one of {', '.join(PERTURBATIONS)}")
    if steps < (1 if how == "inputs" else 2):
        raise ValueError(f"{how} are perturbed before the last step: need 2 steps, got {steps}")
    if draws < 1:
        raise ValueError(f"draws must be at least 1, got {draws}")
    only = tuple(only)
    if how == "activations":
        if not only:
            raise ValueError("activations: name the modules whose outputs move (only=...)")
        names = {n for n, _ in net.named_modules()}
    elif how == "inputs":
        if only:
            raise ValueError(f"inputs move the whole batch, not {only}")
        names = set()
    else:
        names = {n for n, _ in net.named_parameters()}
    unknown = [o for o in only if not any(n == o or n.startswith(o + ".") for n in names)]
    if unknown:
        raise ValueError(f"{how}: no module or parameter of the model is named {unknown}")
    kernels = (
        reference_kernels.fp16_kernels() if dtype == torch.float16 else reference_kernels.pinned()
    )
    with kernels:
        return _spread(net, x, y, how, steps, lr, draws, seed, only, size, dtype)


def _spread(
    net: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    how: str,
    steps: int,
    lr: float,
    draws: int,
    seed: int,
    only: tuple[str, ...],
    size: float,
    dtype: torch.dtype,
) -> Spread:
    from qnn_convbwd_dev import fidelity

    reference, _ = _torch_steps(net, x, y, steps, lr, dtype)
    results = []
    if how in ("inputs", "neighbour_gradients"):
        scale = size / fidelity.UNIT_ROUNDOFF
        for (moved,) in fidelity.neighbours((x,), draws + 1, seed)[1:]:
            batch = x + (moved - x) * scale if scale != 1.0 else moved
            if how == "inputs":
                results.append(_torch_steps(net, batch, y, steps, lr, dtype)[0])
                continue
            perturbation = _Perturbation(how, size, only, torch.Generator(), batch)
            results.append(_torch_steps(net, x, y, steps, lr, dtype, perturbation)[0])
    else:
        for draw in range(draws):
            generator = torch.Generator().manual_seed(seed * 1_000_003 + draw)
            perturbation = _Perturbation(how, size, only, generator)
            results.append(_torch_steps(net, x, y, steps, lr, dtype, perturbation)[0])
    return Spread(how, reference, results)


def _steps(
    program: Any, net: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, lr: float
) -> dict[str, Any]:
    """``steps`` SGD steps of ``program`` through ``TrainingSession`` on the batch ``(x, y)``
    against torch's fp32 and fp16 (``.half()``) steps from ``net``'s weights: each loss
    against its bound (``step_floor.loss_bound``), and the first step's gradients against
    torch fp32's, beside torch fp16's own error. Torch's steps run on the pinned kernels
    (``reference_kernels``)."""
    from qnn_convbwd_dev import reference_kernels, step_floor

    session = program.session(lr=lr)
    losses, seconds = [], []
    try:
        for index in range(steps):
            start = time.perf_counter()
            losses.append(float(session.forward_backward([x, y])[0]))
            if index == 0:
                ours = {program.layout.eager_name(n): g for n, g in session.gradients().items()}
            session.optimizer_step()
            seconds.append(time.perf_counter() - start)
    finally:
        session.close()
    # Torch's steps on the pinned kernels: a lowering changes the process's oneDNN
    # setting, and the hypersensitive rows' losses move with the kernels.
    with reference_kernels.pinned():
        fp32, reference = _torch_steps(net, x, y, steps, lr, torch.float32)
    with reference_kernels.fp16_kernels():
        fp16, half = _torch_steps(net, x, y, steps, lr, torch.float16)
    bounds = [step_floor.loss_bound(a, b - a) for a, b in zip(fp32, fp16)]
    errors = {}
    for name, grad in reference.items():
        scale = max(float(grad.norm()), 1e-30)
        mine = ours[name].float().reshape(grad.shape)
        errors[name] = (
            float((mine - grad).norm()) / scale,
            float((half[name] - grad).norm()) / scale,
        )
    worst = max(errors, key=lambda n: errors[n][0] / max(errors[n][1], 1e-12))
    return {
        "lr": lr,
        "losses": losses,
        "torch_losses": fp32,
        "torch_fp16_losses": fp16,
        "loss_bounds": bounds,
        "losses_within": all(abs(a - b) <= c for a, b, c in zip(losses, fp32, bounds)),
        "step_seconds": seconds,
        "gradients": len(errors),
        "worst_gradient": worst,
        "worst_error": errors[worst][0],
        "worst_fp16_error": errors[worst][1],
        "median_ratio": float(
            torch.tensor([e / max(f, 1e-12) for e, f in errors.values()]).median()
        ),
    }


def step_noise(
    net: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    steps: int = 2,
    lr: float = 0.01,
    draws: int = 16,
    seed: int = 0,
) -> list[dict[str, float]]:
    """Per step, how far fp16-sized differences move torch's loss, over the batch and its
    ``draws - 1`` neighbours (``loss_spread``'s ``inputs``, in fp32 and in fp16): torch
    fp32's loss on the batch (``fp32``) and how far its neighbours' move from it (median
    and largest), torch fp16's gap to fp32 on each draw (median, smallest, largest; the
    batch's own is ``fp16_gap``), the one-draw bound that gap sets, the multi-draw bound
    (``step_floor.loss_verdict``) and ``step_floor.fp16_pass_fraction``."""
    from qnn_convbwd_dev import step_floor

    if draws < 2:
        raise ValueError(f"step noise needs the batch and at least one neighbour: {draws}")
    fp32 = loss_spread(net, x, y, "inputs", steps=steps, lr=lr, draws=draws - 1, seed=seed)
    fp16 = loss_spread(
        net, x, y, "inputs", steps=steps, lr=lr, draws=draws - 1, seed=seed, dtype=torch.float16
    )
    rows = []
    for step in range(steps):
        theirs, half = fp32.losses(step), fp16.losses(step)
        gaps = [abs(h - r) for h, r in zip(half, theirs)]
        verdict = step_floor.loss_verdict(half, theirs, half)
        rows.append(
            {
                "fp32": theirs[0],
                "fp32_median": fp32.median(step),
                "fp32_max": fp32.maximum(step),
                "fp16_gap": gaps[0],
                "fp16_median": verdict.floor,
                "fp16_min": min(gaps),
                "fp16_max": max(gaps),
                "one_draw_bound": step_floor.loss_bound(theirs[0], gaps[0]),
                "bound": verdict.bound,
                "pass_fraction": step_floor.fp16_pass_fraction(theirs, half),
            }
        )
    return rows


def noise_markdown(arch: str, rows: Sequence[dict[str, float]]) -> str:
    """``step_noise``'s rows as a table, one line per step."""
    lines = [
        f"{arch}: torch's losses over the batch and its fp16 neighbours",
        "",
        "| step | torch fp32 | fp32 moved: median / max | torch fp16 gap: batch, median "
        "(min-max) | bound: one draw / multi-draw | fp16 passes one draw |",
        "|---|---|---|---|---|---|",
    ]
    for index, r in enumerate(rows, start=1):
        lines.append(
            f"| {index} | {r['fp32']:.4f} | {r['fp32_median']:.4f} / {r['fp32_max']:.4f} | "
            f"{r['fp16_gap']:.4f}, {r['fp16_median']:.4f} ({r['fp16_min']:.4f}-"
            f"{r['fp16_max']:.4f}) | {r['one_draw_bound']:.4f} / {r['bound']:.4f} | "
            f"{r['pass_fraction']:.0%} |"
        )
    return "\n".join(lines)


def sweep_one(
    arch: str,
    scheme: str = "full",
    *,
    soc: str = "SM8650",
    batch: int = 4,
    size: int | None = None,
    lower: bool = False,
    steps: int = 0,
    lr: float = 0.01,
    seed: int = 0,
) -> Row:
    """One model: ``decide`` (or, with ``lower``, a real lowering and with ``steps`` that
    many SGD steps of learning rate ``lr`` on the simulator). ``size`` None: 32, or the
    model's smallest size above that."""
    import qnn_convbwd
    from qnn_convbwd import training
    from qnn_convbwd.toolchain import harness

    if steps and not lower:
        raise ValueError("steps need lower=True")
    size = smallest_size(arch) if size is None else size
    # Steps compared with torch's need the same computation: no stochastic-depth draws.
    net, x, y = train_mode_batch(arch, scheme, batch, size, seed, stochastic_depth=not steps)
    module = training.WithLoss(copy.deepcopy(net), nn.functional.cross_entropy)
    specs = harness.compile_specs(soc)
    start = time.perf_counter()
    if not lower:
        joint = training.export_joint(module, (x, y))
        exported = time.perf_counter() - start
        start = time.perf_counter()
        report = qnn_convbwd.decide(joint, specs)
        seconds = time.perf_counter() - start
        return Row(
            arch, scheme, size, batch, soc, "decide", exported, seconds, count_on_cpu(report.on_cpu)
        )
    program = training.lower_for_training(module, (x, y), specs)
    row = Row(
        arch,
        scheme,
        size,
        batch,
        soc,
        "lower",
        0.0,
        program.lowering_seconds,
        count_on_cpu(program.report.on_cpu),
        delegates=harness.delegate_count(program.edge),
    )
    if steps:
        row.step = _steps(program, net, x, y, steps, lr)
    return row


def sweep(
    archs: Sequence[str],
    schemes: Sequence[str] = ("full",),
    *,
    on_row: Any = None,
    **options: Any,
) -> list[Row]:
    """``sweep_one`` over every architecture and scheme; a model that fails is a row with
    its ``error`` (the others go on). ``on_row(row)`` is called after each."""
    rows = []
    for arch in archs:
        for scheme in schemes:
            try:
                row = sweep_one(arch, scheme, **options)
            except Exception as err:  # a model the flow cannot take: recorded, not fatal
                logger.exception("%s %s: not swept", arch, scheme)
                row = Row(arch, scheme, 0, 0, options.get("soc", "SM8650"), "", 0.0, 0.0, {})
                row.error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            rows.append(row)
            if on_row is not None:
                on_row(row)
    return rows


def _ops(counts: dict[str, int]) -> str:
    return ", ".join(
        f"{n} `{key.split(' ', 1)[1]}` ({key.split(' ')[0]})" for key, n in counts.items()
    )


def markdown(rows: Sequence[Row]) -> str:
    """One line per model and scheme: ops on CPU per kind, the gaps spelt out."""
    lines = [
        "| model | scheme | px | how | seconds | delegates | state | follows | gaps | "
        "gap ops (rule) | SGD steps: loss / torch fp32 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.error is not None:
            lines.append(f"| {r.arch} | {r.scheme} | | | | | | | | not swept: {r.error} | |")
            continue
        step = ""
        if r.step is not None:
            s = r.step
            pairs = ", ".join(
                f"{mine:.4f}/{theirs:.4f}" for mine, theirs in zip(s["losses"], s["torch_losses"])
            )
            step = (
                f"losses {pairs} ({'within' if s['losses_within'] else 'OUT'}); worst "
                f"gradient {s['worst_error']:.1e} (torch fp16 {s['worst_fp16_error']:.1e})"
            )
        lines.append(
            f"| {r.arch} | {r.scheme} | {r.size} | {r.how} | {r.seconds:.0f} | "
            f"{'-' if r.delegates is None else r.delegates} | {r.count(STATE)} | "
            f"{r.count(FOLLOWS)} | {r.count(GAP)} | {_ops(r.on_cpu.get(GAP, {})) or '-'} | "
            f"{step or '-'} |"
        )
    return "\n".join(lines)


def write(rows: Sequence[Row], out: str | Path) -> tuple[Path, Path]:
    """``out``.md (``markdown``) and ``out``.json (the rows as they are)."""
    out = Path(out)
    md, js = out.with_suffix(".md"), out.with_suffix(".json")
    md.write_text(markdown(rows) + "\n")
    js.write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1) + "\n")
    return md, js
