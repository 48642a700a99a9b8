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
import logging
import time

import torch
from torch import nn

from qnn_convbwd import finetune

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
    ``train()``; returned in ``eval()``."""
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


@dataclasses.dataclass
class DomainShift:
    shift: str
    quantization: str
    scheme: str
    pretrain_seconds: float
    float_accuracy: float  # the fp32 model on the original test split
    quantized_accuracy: float  # the quantized model on the original test split
    shifted_before: float  # the quantized model on the shifted test split, before
    program_accuracy: float  # after the fine-tune, the program's head
    torch_accuracy: float  # after the same steps in torch
    steps: int
    lowering_seconds: float
    mean_step_seconds: float
    delegates: int
    on_cpu: dict[str, int]
    losses: list[tuple[float, float]]  # (program, torch) per step

    @property
    def gap_points(self) -> float:
        return 100 * abs(self.program_accuracy - self.torch_accuracy)


def run(
    shift: str = "invert",
    quantization: str = "8a8w",
    scheme: str = finetune.QUANTIZED_SCHEME,
    soc: str = "SM8650",
    steps: int | None = None,
    epochs: int | None = 1,
    batch: int = 16,
    lr: float = 0.02,
    momentum: float = 0.9,
    pretrain_epochs: int = 3,
    pretrain_samples: int | None = None,
    calibration_batches: int = finetune.CALIBRATION_BATCHES,
    seed: int = 0,
) -> DomainShift:
    """Pretrain, quantize on the original digits, fine-tune ``scheme`` on the shifted ones
    (``steps``, else ``epochs`` of the shifted training split) beside torch."""
    split = finetune.digits(32, seed)
    start = time.perf_counter()
    net = pretrain(split, epochs=pretrain_epochs, seed=seed, samples=pretrain_samples)
    pretrain_seconds = time.perf_counter() - start
    net = finetune.apply_scheme(net, scheme)
    model, _ = finetune.quantize_for_fit(
        copy.deepcopy(net), split.train, batch, quantization, calibration_batches, seed
    )
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
        lr=lr,
        momentum=momentum,
        seed=seed,
        train_mode=False,
        eval_every=10**9,
    )
    before, after = result.evaluations[0], result.evaluations[-1]
    return DomainShift(
        shift=shift,
        quantization=quantization,
        scheme=scheme,
        pretrain_seconds=pretrain_seconds,
        float_accuracy=finetune.accuracy(net, split.test),
        quantized_accuracy=finetune.accuracy(model, split.test),
        shifted_before=before.program_accuracy,
        program_accuracy=after.program_accuracy,
        torch_accuracy=after.torch_accuracy,
        steps=len(result.steps),
        lowering_seconds=result.lowering_seconds,
        mean_step_seconds=result.mean_step_seconds,
        delegates=result.delegates,
        on_cpu=result.on_cpu_by_rule(),
        losses=[(s.program_loss, s.torch_loss) for s in result.steps],
    )


def lines(found: DomainShift) -> list[str]:
    """What the script prints."""
    gaps = [abs(a - b) for a, b in found.losses]
    return [
        f"shift {found.shift}, backbone {found.quantization}, scheme {found.scheme}: "
        f"{found.steps} steps",
        f"original test split: fp32 {100 * found.float_accuracy:.1f}%, quantized "
        f"{100 * found.quantized_accuracy:.1f}% (pretraining {found.pretrain_seconds:.0f} s)",
        f"shifted test split before the fine-tune: {100 * found.shifted_before:.1f}%",
        f"after: program {100 * found.program_accuracy:.1f}%, torch "
        f"{100 * found.torch_accuracy:.1f}% ({found.gap_points:.1f} points apart)",
        f"lowering {found.lowering_seconds:.1f} s, {found.delegates} delegate(s), on CPU "
        f"{found.on_cpu or 'none'}, {found.mean_step_seconds:.2f} s a step",
        f"loss gap per step: max {max(gaps):.2e} (step {gaps.index(max(gaps))}), mean "
        f"{sum(gaps) / len(gaps):.2e}, first three " + ", ".join(f"{g:.1e}" for g in gaps[:3]),
    ]
