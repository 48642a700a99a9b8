"""Fine-tune a classifier through a lowered training program, next to torch.

* ``architecture``: ExecuTorch's CIFAR-10 example CNN or a torchvision classifier,
  randomly initialised from a seed.
* ``apply_scheme``: which parameters train (``SCHEMES``).
* ``digits``: scikit-learn's handwritten digits as small RGB images, split once.
* ``fit``: trains the model in ``train()`` through the program
  (``training.lower_for_training``, then ``TrainingProgram.session``) and, on
  the same batches, an fp32 eager copy with ``torch.optim.SGD``; evaluates both
  on the test set. ``FitResult.plot`` draws both curves.

scikit-learn and matplotlib come with the ``finetune`` extra
(``pip install 'qnn-convbwd[finetune]'``).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import importlib.util
import json
import logging
import math
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

SCHEMES = ("full", "last-layers", "bias-only", "adapter")
# The adapter scheme puts a residual adapter after each of this many blocks, the ones
# before the backbone's last block.
ADAPTED_BLOCKS = 2
TRAIN_SAMPLES, TEST_SAMPLES = 1500, 297  # scikit-learn's 1,797 digits
EXTRA = "pip install 'qnn-convbwd[finetune]'"
# The torch copy's dropout masks in ``fit``: the program's, or its own.
TORCH_MASKS = ("program", "own")


class MissingDependency(ImportError):
    """scikit-learn or matplotlib is not installed; the message says how to install it."""


def _require(module: str, package: str, what: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise MissingDependency(f"{what} needs {package}, which is not installed: {EXTRA}")


# --- architectures --------------------------------------------------------------------


def architecture(arch: str, classes: int = 10, seed: int = 0) -> nn.Module:
    """A classifier of ``classes`` classes with random weights drawn from ``seed``.

    ``"cifar"``: ExecuTorch's CIFAR-10 example (``CIFAR10Model``: three 3x3
    convolutions with max pools, two linear layers, dropout 0.5 as shipped; 32x32
    input). Any other name is a torchvision classification model (``resnet18``,
    ``mobilenet_v2``, ``mobilenet_v3_small``, ``efficientnet_b0``,
    ``shufflenet_v2_x0_5``, ...) built with ``num_classes=classes``. The global
    random state is left as it was.
    """
    if arch == "cifar":
        from executorch.extension.training.examples.CIFAR.model import CIFAR10Model

        build: Callable[[], nn.Module] = lambda: CIFAR10Model(num_classes=classes)  # noqa: E731
    else:
        from .torchvision_import import import_torchvision

        models = import_torchvision().models
        if arch not in models.list_models(module=models):
            raise ValueError(
                f"unknown architecture {arch!r}: 'cifar' or a torchvision classifier "
                f"({', '.join(sorted(models.list_models(module=models)))})"
            )
        build = lambda: models.get_model(arch, weights=None, num_classes=classes)  # noqa: E731
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


# --- schemes --------------------------------------------------------------------------


def head(net: nn.Module) -> str:
    """Name of the classifier head: the last ``nn.Linear`` (the layer giving the classes)."""
    linears = [name for name, m in net.named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError(f"{type(net).__name__}: no nn.Linear, so no classifier head to train")
    return linears[-1]


def blocks(net: nn.Module) -> list[str]:
    """Names of the backbone's blocks, in order.

    The entries with parameters of ``features`` when the model has that
    ``nn.Sequential`` (the CIFAR example, MobileNet, EfficientNet); otherwise the
    model's own children with parameters (ResNet: ``conv1``, ``bn1``, ``layer1`` ..
    ``layer4``; ShuffleNetV2: ``conv1``, ``stage2`` .. ``stage4``, ``conv5``). The
    child holding the head is not a block.
    """
    children = dict(net.named_children())
    features = children.get("features")
    if isinstance(features, nn.Sequential):
        return [f"features.{name}" for name, m in features.named_children() if _has_parameters(m)]
    top = head(net).split(".", 1)[0]
    return [name for name, m in children.items() if name != top and _has_parameters(m)]


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


class ResidualAdapter(nn.Module):
    """``y = block(x)``, then ``y + conv1x1(y)``; the 1x1 convolution starts at zero, so
    the adapted model computes what the backbone did until the adapter trains."""

    def __init__(self, block: nn.Module, channels: int) -> None:
        super().__init__()
        self.block = block
        self.adapter = nn.Conv2d(channels, channels, 1)
        nn.init.zeros_(self.adapter.weight)
        nn.init.zeros_(self.adapter.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        return y + self.adapter(y)


def _output_channels(net: nn.Module, names: list[str], size: int) -> dict[str, int]:
    """Channels of each named block's output, from one eval-mode pass over zeros."""
    found: dict[str, int] = {}

    def record(name: str) -> Callable:
        def hook(_module: nn.Module, _inputs: Any, output: torch.Tensor) -> None:
            found[name] = output.shape[1]

        return hook

    hooks = [net.get_submodule(name).register_forward_hook(record(name)) for name in names]
    was_training = net.training
    try:
        with torch.no_grad():
            net.eval()(torch.zeros(1, 3, size, size))
    finally:
        net.train(was_training)
        for hook in hooks:
            hook.remove()
    return found


def _replace(net: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(net.get_submodule(parent) if parent else net, child, module)


def apply_scheme(net: nn.Module, scheme: str, size: int = 32) -> nn.Module:
    """Set which parameters of ``net`` train (``requires_grad``); returns ``net``.

    * ``full``: every parameter;
    * ``last-layers``: the last of ``blocks(net)`` and every parameter registered
      after it (the classifier; ShuffleNet's ``conv5`` is its last block);
    * ``bias-only``: every bias, batch-norm biases included, and the head
      (``head(net)``, the last ``nn.Linear``, which a new task starts from scratch);
      the TinyTL recipe;
    * ``adapter``: the backbone frozen; a ``ResidualAdapter`` (a zero-initialised
      1x1 convolution, residual) after each of the ``ADAPTED_BLOCKS`` blocks before
      the last one, and the head, train. Modifies ``net`` in place (the adapted
      blocks move under ``<block>.block``); ``size`` is the input size of the pass
      that finds each block's channels.

    Frozen batch norms still normalise with the batch's statistics and update their
    running statistics in ``train()``, as in torch.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme {scheme!r}: one of {', '.join(SCHEMES)}")
    names = [name for name, _ in net.named_parameters()]
    top = head(net) + "."
    if scheme == "full":
        train = set(names)
    elif scheme == "bias-only":
        train = {n for n in names if n.endswith(".bias") or n.startswith(top)}
    elif scheme == "last-layers":
        last = blocks(net)[-1] + "."
        first = next(i for i, n in enumerate(names) if n.startswith(last))
        train = set(names[first:])
    else:
        chosen = blocks(net)[-1 - ADAPTED_BLOCKS : -1]
        if len(chosen) < ADAPTED_BLOCKS:
            raise ValueError(
                f"{type(net).__name__}: {len(blocks(net))} blocks, too few for "
                f"{ADAPTED_BLOCKS} adapters before the last"
            )
        channels = _output_channels(net, chosen, size)
        for name in chosen:
            _replace(net, name, ResidualAdapter(net.get_submodule(name), channels[name]))
        adapters = tuple(f"{name}.adapter." for name in chosen)
        train = {n for n, _ in net.named_parameters() if n.startswith((top, *adapters))}
    for name, parameter in net.named_parameters():
        parameter.requires_grad_(name in train)
    return net


def trainable_names(net: nn.Module) -> list[str]:
    return [name for name, p in net.named_parameters() if p.requires_grad]


# --- data -----------------------------------------------------------------------------


@dataclasses.dataclass
class Split:
    train: tuple[torch.Tensor, torch.Tensor]  # images (N, 3, size, size) in [0, 1], labels
    test: tuple[torch.Tensor, torch.Tensor]


def digits(size: int = 32, seed: int = 0) -> Split:
    """scikit-learn's handwritten digits (``load_digits``, shipped with scikit-learn): 1,500
    training and 297 test images, split by a permutation drawn from ``seed``.

    The 8x8 images (grey levels 0..16) are scaled to [0, 1], upsampled to ``size`` x
    ``size`` (bilinear) and repeated over 3 channels; labels are int64 digits 0..9.
    """
    _require("sklearn", "scikit-learn", "digits()")
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = nn.functional.interpolate(
        images, size=(size, size), mode="bilinear", align_corners=False
    ).clamp(0.0, 1.0)
    images = images.expand(-1, 3, -1, -1).contiguous()
    labels = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    train, test = order[:TRAIN_SAMPLES], order[TRAIN_SAMPLES : TRAIN_SAMPLES + TEST_SAMPLES]
    return Split((images[train], labels[train]), (images[test], labels[test]))


def _epoch_batches(data: Any, batch: int, generator: torch.Generator) -> Iterator[tuple]:
    """One epoch of ``(x, y)`` batches of exactly ``batch`` samples (others dropped)."""
    if isinstance(data, torch.utils.data.DataLoader):
        for x, y in data:
            if len(x) == batch:
                yield x, y
            else:
                logger.info(
                    "dropped a batch of %d samples (the program's batch is %d)", len(x), batch
                )
        return
    x, y = data
    order = torch.randperm(len(x), generator=generator)
    for start in range(0, len(x) - batch + 1, batch):
        index = order[start : start + batch]
        yield x[index], y[index]


def _steps_per_epoch(data: Any, batch: int) -> int:
    if isinstance(data, torch.utils.data.DataLoader):
        return sum(1 for x, _ in data if len(x) == batch)
    return len(data[0]) // batch


def _test_batches(data: Any) -> Iterator[tuple]:
    if isinstance(data, torch.utils.data.DataLoader):
        yield from data
        return
    x, y = data
    for start in range(0, len(x), 256):
        yield x[start : start + 256], y[start : start + 256]


def accuracy(net: nn.Module, test: Any) -> float:
    """Fraction of ``test`` that ``net`` in ``eval()`` classifies right (``net`` is left in
    the mode it was in)."""
    was_training = net.training
    net.eval()
    right = total = 0
    try:
        with torch.no_grad():
            for x, y in _test_batches(test):
                right += int((net(x).argmax(dim=1) == y).sum())
                total += len(y)
    finally:
        net.train(was_training)
    return right / total


# --- fit ------------------------------------------------------------------------------


@dataclasses.dataclass
class Step:
    program_loss: float  # the program's loss on the batch, before its update
    torch_loss: float  # torch eager fp32's, same batch and step
    seconds: float  # the program's step (forward_backward + SGD update)
    torch_seconds: float  # torch eager's step


@dataclasses.dataclass
class Evaluation:
    step: int  # steps done when evaluated
    epoch: float  # step / steps per epoch
    program_accuracy: float  # torch eager, eval(), on the program's state_dict
    torch_accuracy: float


@dataclasses.dataclass
class FitResult:
    name: str
    scheme: str
    soc: str
    cpu_only: bool
    train_mode: bool
    batch: int
    lr: float
    trainable: int  # trainable parameter elements
    lowering_seconds: float
    delegates: int
    on_cpu: list  # qnn_convbwd.CpuOp of every op the program keeps on CPU
    dropped_per_epoch: int  # training samples past the last full batch (tensor data)
    steps: list[Step] = dataclasses.field(default_factory=list)
    evaluations: list[Evaluation] = dataclasses.field(default_factory=list)
    # The trained models' state_dicts (the scheme's model's names): the program's
    # (``session.state_dict()``) and torch's, after the last step.
    program_state: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    torch_state: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    @property
    def mean_step_seconds(self) -> float:
        """Mean seconds of the program's steps after the first (which loads the delegates);
        the first one alone when there is only one."""
        timed = self.steps[1:] or self.steps
        return sum(s.seconds for s in timed) / len(timed) if timed else math.nan

    @property
    def mean_torch_step_seconds(self) -> float:
        timed = self.steps[1:] or self.steps
        return sum(s.torch_seconds for s in timed) / len(timed) if timed else math.nan

    def on_cpu_by_rule(self) -> dict[str, int]:
        """How many ops each partition rule kept on CPU."""
        return dict(collections.Counter(op.rule for op in self.on_cpu).most_common())

    def plot(self, path: str | Path) -> Path:
        """A PNG of both loss curves and both accuracy curves.

        Drawn by ``fit_plot.py`` in a child process: importing matplotlib into a
        process where executorch's runtime has loaded the QNN libraries crashes it
        (a segfault in matplotlib's font module import, executorch 1.5.1).
        """
        _require("matplotlib", "matplotlib", "FitResult.plot()")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        where = "CPU-only program" if self.cpu_only else f"program, {self.soc}"
        data = {
            "title": f"{self.name}, {self.scheme}, batch {self.batch}, lr {self.lr:g}"
            + ("" if self.train_mode else ", eval mode"),
            "program": where,
            "program_loss": [s.program_loss for s in self.steps],
            "torch_loss": [s.torch_loss for s in self.steps],
            "eval_steps": [e.step for e in self.evaluations],
            "program_accuracy": [e.program_accuracy for e in self.evaluations],
            "torch_accuracy": [e.torch_accuracy for e in self.evaluations],
            "path": str(path),
        }
        script = Path(__file__).with_name("fit_plot.py")
        done = subprocess.run(
            [sys.executable, str(script)], input=json.dumps(data), capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(f"plotting failed: {done.stderr[-1000:]}")
        return path


def fit(
    model: nn.Module,
    train: Any,
    test: Any,
    *,
    scheme: str = "full",
    soc: str = "SM8650",
    batch: int = 16,
    steps: int | None = None,
    epochs: int | None = None,
    lr: float = 0.05,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    seed: int = 0,
    cpu_only: bool = False,
    train_mode: bool = True,
    torch_masks: str = "program",
    eval_every: int | None = None,
    on_progress: Callable[[FitResult, int, Evaluation | None], None] | None = None,
) -> FitResult:
    """Train a copy of ``model`` (cross-entropy) through the lowered program and, on the
    same batches, an fp32 eager copy with ``torch.optim.SGD``; both from the same weights.

    ``train`` and ``test`` are ``(images, labels)`` tensors or ``DataLoader``\\ s. The
    program's batch is fixed at lowering, so only batches of exactly ``batch``
    samples train: tensor data is shuffled each epoch (seeded by ``seed`` and the
    epoch) and the samples past the last full batch are dropped that epoch; a
    ``DataLoader``'s batches of another size are skipped. ``steps`` or ``epochs``
    (one epoch when neither) says how long. ``scheme`` is applied to the copy
    (``apply_scheme``). The models train in ``train()`` (batch statistics, dropout),
    or in ``eval()`` with ``train_mode=False``. The program draws its dropout masks
    from ``seed``; ``torch_masks="program"`` has the torch copy drop the same elements
    (``passes.dropout.ProgramMasks``), so the two runs differ by their arithmetic
    alone, and ``"own"`` has it draw its own masks from ``seed``.

    Both are evaluated before the first step, every ``eval_every`` steps (default:
    each epoch) and after the last: the program's accuracy is an eager copy's in
    ``eval()`` after ``load_state_dict(session.state_dict())``, so its running
    statistics count. ``cpu_only`` lowers the same joint graph for SM8350 (HTP V68),
    where the partition rules keep a training graph on CPU as a whole: no delegate,
    for comparing step times. ``on_progress(result, total, evaluation)`` is called
    before the first step and after every step with the result so far (its
    ``steps`` done of ``total``) and the evaluation made at that step, if any.
    """
    from . import training
    from .api import enabled
    from .passes import dropout
    from .toolchain import harness

    if steps is not None and epochs is not None:
        raise ValueError("give steps or epochs, not both")
    if torch_masks not in TORCH_MASKS:
        raise ValueError(f"torch_masks={torch_masks!r}: one of {', '.join(TORCH_MASKS)}")
    net = apply_scheme(copy.deepcopy(model), scheme)
    net.train(train_mode)
    trainable = trainable_names(net)
    if not trainable:
        raise ValueError(f"scheme {scheme!r} leaves nothing to train")
    per_epoch = _steps_per_epoch(train, batch)
    if per_epoch == 0:
        raise ValueError(f"no batch of {batch} samples in the training data")
    total = steps if steps is not None else per_epoch * (epochs or 1)
    eval_every = eval_every or per_epoch
    dropped = 0 if isinstance(train, torch.utils.data.DataLoader) else len(train[0]) % batch

    reference = copy.deepcopy(net)
    optimizer = torch.optim.SGD(
        [p for p in reference.parameters() if p.requires_grad],
        lr=lr,
        momentum=momentum,
        weight_decay=weight_decay,
    )
    loss = nn.CrossEntropyLoss()
    batches = _batches(train, batch, seed)
    first = next(batches)
    target_soc = "SM8350" if cpu_only else soc
    wrapped = training.WithLoss(copy.deepcopy(net), loss)
    with enabled(dropout_seed=seed):
        program = training.lower_for_training(wrapped, first, harness.compile_specs(target_soc))
    sites: list[dropout.Site] = []
    if train_mode and torch_masks == "program":
        # The program's draws, recomputed from the seed: the joint graph, rewritten.
        _, sites = dropout.rewrite(training.export_joint(wrapped, first), seed)
    delegates = harness.delegate_count(program.edge)
    if cpu_only and delegates:
        raise RuntimeError(f"the CPU-only program has {delegates} delegate(s)")
    result = FitResult(
        name=type(model).__name__,
        scheme=scheme,
        soc=target_soc,
        cpu_only=cpu_only,
        train_mode=train_mode,
        batch=batch,
        lr=lr,
        trainable=sum(p.numel() for p in net.parameters() if p.requires_grad),
        lowering_seconds=program.lowering_seconds,
        delegates=delegates,
        on_cpu=list(program.report.on_cpu),
        dropped_per_epoch=dropped,
    )
    session = program.session(lr, momentum=momentum, weight_decay=weight_decay)
    evaluated = copy.deepcopy(net)

    def evaluate(done: int) -> Evaluation:
        evaluated.load_state_dict(session.state_dict())
        found = Evaluation(
            done, done / per_epoch, accuracy(evaluated, test), accuracy(reference, test)
        )
        result.evaluations.append(found)
        return found

    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # torch's own dropout masks (torch_masks="own")
            evaluation = evaluate(0)
            if on_progress is not None:
                on_progress(result, total, evaluation)
            x, y = first
            for done in range(1, total + 1):
                start = time.perf_counter()
                program_loss = session.step((x, y))
                seconds = time.perf_counter() - start
                start = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                if sites:
                    with dropout.ProgramMasks(sites, done - 1):
                        torch_loss = loss(reference(x), y)
                else:
                    torch_loss = loss(reference(x), y)
                torch_loss.backward()
                optimizer.step()
                torch_seconds = time.perf_counter() - start
                result.steps.append(
                    Step(program_loss, float(torch_loss.detach()), seconds, torch_seconds)
                )
                evaluation = evaluate(done) if done % eval_every == 0 or done == total else None
                if on_progress is not None:
                    on_progress(result, total, evaluation)
                if done < total:
                    x, y = next(batches)
        result.program_state = session.state_dict()
        result.torch_state = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    finally:
        session.close()
    return result


def _batches(data: Any, batch: int, seed: int) -> Iterator[tuple]:
    """Batches of exactly ``batch`` samples, epoch after epoch."""
    epoch = 0
    while True:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        yield from _epoch_batches(data, batch, generator)
        epoch += 1
