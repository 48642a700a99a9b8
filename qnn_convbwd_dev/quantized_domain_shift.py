"""A quantized backbone's head fine-tuned on a shifted domain, on the simulator, beside
torch (docs/quantized.md).

1. ``pretrain``: ExecuTorch's CIFAR model trained in fp32 on scikit-learn's digits (the
   split ``finetune.digits`` makes, 32x32 RGB) on CPU with ``torch.optim.SGD``.
2. ``qnn_convbwd.finetune.quantize_for_fit``: its backbone quantized (8a8w by default,
   per-channel weights) and calibrated on the original digits' training images; the
   head (``classifier``) and the adapters stay float.
3. ``finetune.fit`` on the shifted digits (``SHIFTS``: inverted, ``1 - x``, or rotated
   90 degrees) with ``scheme`` ``"head"`` (the float head alone) or ``"adapter"`` (float
   residual adapters inside the quantized backbone, and the head): the training program
   on the HTP simulator and
   torch running the same converted backbone in fp32, on the same batches with the same
   in-program optimizer and learning rate, both in ``eval()`` (no dropout, so the two
   runs differ by their arithmetic alone). Accuracies on the shifted test split before
   and after, program and torch.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import math
import time

import torch
from torch import nn

from qnn_convbwd import finetune, quantized

logger = logging.getLogger(__name__)

SHIFTS = ("invert", "rotate")


def shifted(split: finetune.Split, shift: str) -> finetune.Split:
    """``split``'s images inverted (``1 - x``) or rotated by 90 degrees, labels as they
    were."""
    if shift == "invert":
        move = lambda x: 1.0 - x  # noqa: E731
    elif shift == "rotate":
        move = lambda x: torch.rot90(x, 1, dims=(2, 3)).contiguous()  # noqa: E731
    else:
        raise ValueError(f"shift {shift!r}: one of {', '.join(SHIFTS)}")
    return finetune.Split(
        (move(split.train[0]), split.train[1]), (move(split.test[0]), split.test[1])
    )


def pretrain(
    split: finetune.Split,
    arch: str = "cifar",
    epochs: int = 3,
    batch: int = 32,
    lr: float = 0.05,
    seed: int = 0,
    samples: int | None = None,
) -> nn.Module:
    """``arch`` (weights from ``seed``) trained in fp32 on ``split.train`` (its first
    ``samples`` when given) for ``epochs`` epochs, SGD with momentum 0.9, in
    ``train()``; returned in ``eval()``.

    It runs with torch's MKLDNN backend on (when available), the setting a fresh
    process starts with: executorch's Qualcomm backend turns it off for the rest of the
    process on an AMD host once a quantizer or a lowering starts, and the convolutions'
    other fp32 arithmetic, over a few epochs, gives other weights; with it pinned, a
    model trained after a lowering in one process is the one a fresh process trains."""
    with torch.backends.mkldnn.flags(enabled=torch.backends.mkldnn.is_available()):
        return _pretrain(split, arch, epochs, batch, lr, seed, samples)


def _pretrain(
    split: finetune.Split,
    arch: str,
    epochs: int,
    batch: int,
    lr: float,
    seed: int,
    samples: int | None,
) -> nn.Module:
    net = finetune.architecture(arch, seed=seed).train()
    x, y = split.train
    if samples is not None:
        x, y = x[:samples], y[:samples]
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # the dropout masks
        for _ in range(epochs):
            order = torch.randperm(len(x), generator=generator)
            for start in range(0, len(x) - batch + 1, batch):
                index = order[start : start + batch]
                optimizer.zero_grad()
                nn.functional.cross_entropy(net(x[index]), y[index]).backward()
                optimizer.step()
    return net.eval()


def _build(
    split: finetune.Split,
    scheme: str,
    quantization: str,
    batch: int,
    pretrain_epochs: int,
    pretrain_samples: int | None,
    calibration_batches: int,
    seed: int,
) -> tuple[nn.Module, nn.Module]:
    """The pretrained float model with ``scheme`` applied (``pretrain``, on the MKLDNN
    backend a fresh process has), and its quantized copy."""
    net = pretrain(split, epochs=pretrain_epochs, seed=seed, samples=pretrain_samples)
    net = finetune.apply_scheme(net, scheme)
    model, _ = finetune.quantize_for_fit(
        copy.deepcopy(net), split.train, batch, quantization, calibration_batches, seed
    )
    return net, model


@dataclasses.dataclass(frozen=True)
class Protocol:
    """How a scheme fine-tunes: ``head_epochs`` epochs of the head alone first (SGD at
    ``head_lr`` with ``head_momentum``), then the scheme's trained tensors at ``lr``
    with ``momentum``."""

    lr: float
    momentum: float
    head_epochs: int = 0
    head_lr: float = 0.02
    head_momentum: float = 0.9


# The head alone: one epoch at 0.02 with momentum 0.9. Adapters: that epoch of the head
# first, then the adapters and the head together at a quarter of the rate
# (docs/quantized.md: from the shifted domain's first, badly wrong head their
# gradients move the backbone's features far and the run depends on fp32 rounding).
PROTOCOLS = {
    "head": Protocol(lr=0.02, momentum=0.9),
    "adapter": Protocol(lr=0.005, momentum=0.9, head_epochs=1),
}


@dataclasses.dataclass
class Phase:
    """One ``finetune.fit`` of the run: the program and torch after it."""

    scheme: str
    lr: float
    momentum: float
    program_accuracy: float
    torch_accuracy: float
    steps: int
    lowering_seconds: float
    mean_step_seconds: float
    delegates: int
    on_cpu: dict[str, int]
    losses: list[tuple[float, float]]  # (program, torch) per step

    @property
    def gap_points(self) -> float:
        return 100 * abs(self.program_accuracy - self.torch_accuracy)


@dataclasses.dataclass
class DomainShift:
    shift: str
    quantization: str
    scheme: str
    pretrain_seconds: float
    float_accuracy: float  # the fp32 model on the original test split
    quantized_accuracy: float  # the quantized model on the original test split
    shifted_before: float  # the quantized model on the shifted test split, before
    phases: list[Phase]  # the head alone first (a warm start), if any, then the scheme

    @property
    def last(self) -> Phase:
        return self.phases[-1]

    @property
    def program_accuracy(self) -> float:
        return self.last.program_accuracy

    @property
    def torch_accuracy(self) -> float:
        return self.last.torch_accuracy

    @property
    def gap_points(self) -> float:
        return self.last.gap_points

    @property
    def delegates(self) -> int:
        return self.last.delegates

    @property
    def on_cpu(self) -> dict[str, int]:
        return self.last.on_cpu

    @property
    def losses(self) -> list[tuple[float, float]]:
        return self.last.losses


def _phase(result: finetune.FitResult, phase: finetune.FitPhase) -> Phase:
    end = phase.first + phase.steps
    after = next(e for e in result.evaluations if e.step == end)
    steps = result.steps[phase.first : end]
    timed = steps[1:] or steps  # after the phase's first step, which loads its program
    return Phase(
        scheme=phase.trains,
        lr=phase.optimizer["lr"],
        momentum=phase.optimizer["momentum"],
        program_accuracy=after.program_accuracy,
        torch_accuracy=after.torch_accuracy,
        steps=phase.steps,
        lowering_seconds=phase.lowering_seconds,
        mean_step_seconds=sum(s.seconds for s in timed) / len(timed),
        delegates=phase.delegates,
        on_cpu=phase.on_cpu,
        losses=[(s.program_loss, s.torch_loss) for s in steps],
    )


def run(
    shift: str = "invert",
    quantization: str = "8a8w",
    scheme: str = finetune.QUANTIZED_SCHEME,
    soc: str = "SM8650",
    steps: int | None = None,
    epochs: int | None = 1,
    batch: int = 16,
    protocol: Protocol | None = None,
    pretrain_epochs: int = 3,
    pretrain_samples: int | None = None,
    calibration_batches: int = finetune.CALIBRATION_BATCHES,
    seed: int = 0,
    cpu_only: bool = False,
) -> DomainShift:
    """Pretrain, quantize on the original digits, fine-tune ``scheme`` on the shifted ones
    beside torch with ``protocol`` (``PROTOCOLS[scheme]`` by default): its
    ``head_epochs`` of the head alone first, if any, then ``steps``, else ``epochs`` of
    the shifted training split, of the scheme: one ``finetune.fit`` with
    ``head_epochs``, each phase its own program and a fresh optimizer on the same batches
    (the same shuffles from ``seed``), torch going on from its own weights. ``cpu_only``
    lowers for SM8350 (nothing delegated) instead of ``soc``."""
    protocol = protocol or PROTOCOLS[scheme]
    if scheme == "head" and protocol.head_epochs:
        raise ValueError("the head scheme has no warm start of the head alone: head_epochs 0")
    split = finetune.digits(32, seed)
    start = time.perf_counter()
    net, model = _build(
        split, scheme, quantization, batch, pretrain_epochs, pretrain_samples,
        calibration_batches, seed,
    )  # fmt: skip
    pretrain_seconds = time.perf_counter() - start
    moved = shifted(split, shift)
    result = finetune.fit(
        model,
        moved.train,
        moved.test,
        scheme=scheme,
        soc=soc,
        batch=batch,
        steps=steps,
        epochs=None if steps is not None else epochs,
        lr=protocol.lr,
        momentum=protocol.momentum,
        seed=seed,
        cpu_only=cpu_only,
        train_mode=False,
        eval_every=10**9,
        head_epochs=protocol.head_epochs,
        head_lr=protocol.head_lr,
        head_momentum=protocol.head_momentum,
    )
    before = result.evaluations[0].program_accuracy
    phases = [_phase(result, phase) for phase in result.phases]
    return DomainShift(
        shift=shift,
        quantization=quantization,
        scheme=scheme,
        pretrain_seconds=pretrain_seconds,
        float_accuracy=finetune.accuracy(net, split.test),
        quantized_accuracy=finetune.accuracy(model, split.test),
        shifted_before=before,
        phases=phases,
    )


def prepared(
    shift: str = "invert",
    scheme: str = finetune.QUANTIZED_SCHEME,
    quantization: str = "8a8w",
    batch: int = 16,
    pretrain_epochs: int = 3,
    calibration_batches: int = finetune.CALIBRATION_BATCHES,
    seed: int = 0,
) -> tuple[nn.Module, finetune.Split]:
    """``run``'s quantized model (``scheme`` applied before quantizing) and the shifted
    split."""
    split = finetune.digits(32, seed)
    _, model = _build(
        split, scheme, quantization, batch, pretrain_epochs, None, calibration_batches, seed
    )
    return model, shifted(split, shift)


def one_ulp_up(x: torch.Tensor) -> torch.Tensor:
    """Each element of ``x`` moved to the next fp32 value towards +inf."""
    return torch.nextafter(x, torch.full_like(x, math.inf))


def torch_fine_tune(
    model: nn.Module,
    moved: finetune.Split,
    scheme: str,
    protocol: Protocol,
    steps: int | None = None,
    epochs: int | None = 1,
    batch: int = 16,
    seed: int = 0,
) -> tuple[float, list[float]]:
    """``run``'s torch side alone: the same phases on the same batches (a fresh
    ``torch.optim.SGD`` each, the quantizes passed by the straight-through estimator, in
    ``eval()``). Returns the accuracy on ``moved.test`` and the losses."""
    net = copy.deepcopy(model).eval()
    quantized.straight_through(net)
    per_epoch = len(moved.train[0]) // batch
    plan = [("head", protocol.head_lr, protocol.head_momentum, protocol.head_epochs * per_epoch)]
    plan = plan if protocol.head_epochs else []
    plan.append((scheme, protocol.lr, protocol.momentum, steps or (epochs or 1) * per_epoch))
    loss = nn.CrossEntropyLoss()
    losses: list[float] = []
    for phase_scheme, lr, momentum, count in plan:
        finetune.apply_scheme(net, phase_scheme)
        trained = [p for p in net.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(trained, lr=lr, momentum=momentum)
        batches = finetune._batches(moved.train, batch, seed)
        for x, y in itertools.islice(batches, count):
            optimizer.zero_grad(set_to_none=True)
            value = loss(net(x), y)
            value.backward()
            optimizer.step()
            losses.append(float(value.detach()))
    return finetune.accuracy(net, moved.test), losses


def torch_spread(
    shift: str = "invert",
    scheme: str = finetune.QUANTIZED_SCHEME,
    protocol: Protocol | None = None,
    seeds: tuple[int, ...] = (0, 1, 2),
    steps: int | None = None,
    epochs: int | None = 1,
    batch: int = 16,
    pretrain_epochs: int = 3,
) -> list[tuple[int, float, float]]:
    """How much the fine-tune's outcome depends on fp32 rounding: per seed, torch's
    accuracy after ``torch_fine_tune`` on the shifted images as they are and on every
    pixel moved one fp32 ulp up (``one_ulp_up``), ``(seed, as_is, nudged)``."""
    protocol = protocol or PROTOCOLS[scheme]
    found = []
    for seed in seeds:
        model, moved = prepared(
            shift, scheme, batch=batch, pretrain_epochs=pretrain_epochs, seed=seed
        )
        nudged = finetune.Split((one_ulp_up(moved.train[0]), moved.train[1]), moved.test)
        run_args = dict(steps=steps, epochs=epochs, batch=batch, seed=seed)
        as_is, _ = torch_fine_tune(model, moved, scheme, protocol, **run_args)
        other, _ = torch_fine_tune(model, nudged, scheme, protocol, **run_args)
        found.append((seed, as_is, other))
    return found


def lines(found: DomainShift) -> list[str]:
    """What the script prints."""
    out = [
        f"shift {found.shift}, backbone {found.quantization}, scheme {found.scheme}",
        f"original test split: fp32 {100 * found.float_accuracy:.1f}%, quantized "
        f"{100 * found.quantized_accuracy:.1f}% (pretraining {found.pretrain_seconds:.0f} s)",
        f"shifted test split before the fine-tune: {100 * found.shifted_before:.1f}%",
    ]
    for phase in found.phases:
        gaps = [abs(a - b) for a, b in phase.losses]
        out += [
            f"{phase.scheme}: {phase.steps} steps, SGD lr {phase.lr:g} momentum "
            f"{phase.momentum:g}: program {100 * phase.program_accuracy:.1f}%, torch "
            f"{100 * phase.torch_accuracy:.1f}% ({phase.gap_points:.1f} points apart)",
            f"  lowering {phase.lowering_seconds:.1f} s, {phase.delegates} delegate(s), on "
            f"CPU {phase.on_cpu or 'none'}, {phase.mean_step_seconds:.2f} s a step",
            f"  loss gap per step: max {max(gaps):.2e} (step {gaps.index(max(gaps))}), mean "
            f"{sum(gaps) / len(gaps):.2e}, first three " + ", ".join(f"{g:.1e}" for g in gaps[:3]),
        ]
    return out
