"""Fine-tune a classifier through a lowered training program, next to torch.

* ``architecture``: ExecuTorch's CIFAR-10 example CNN or a torchvision classifier,
  randomly initialised from a seed.
* ``apply_scheme``: which parameters train (``SCHEMES``).
* ``digits``: scikit-learn's handwritten digits as small RGB images, split once.
* ``fit``: trains the model in ``train()`` through the program, which applies its
  optimizer (SGD or AdamW) itself (``training.lower_for_training(...,
  optimizer=...)``: one call of its ``forward`` is one step), and, on the same
  batches, an fp32 eager copy with the same ``torch.optim`` optimizer; evaluates
  both on the test set. ``FitResult.plot`` draws both curves.

scikit-learn and matplotlib come with the ``finetune`` extra
(``pip install 'qnn-convbwd[finetune]'``).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import hashlib
import importlib.util
import io
import itertools
import json
import logging
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

SCHEMES = ("full", "last-layers", "bias-only", "adapter", "head")
# The schemes that train around a quantized backbone (``fit(quantize=...)``), the first
# the default: the float head, or float adapters inside the backbone and the head.
QUANTIZED_SCHEMES = ("head", "adapter")
QUANTIZED_SCHEME = QUANTIZED_SCHEMES[0]
# Calibration batches of a quantized backbone, drawn from the training data.
CALIBRATION_BATCHES = 16
# The adapter scheme puts a residual adapter after each of this many blocks, the ones
# before the backbone's last block.
ADAPTED_BLOCKS = 2
TRAIN_SAMPLES, TEST_SAMPLES = 1500, 297  # scikit-learn's 1,797 digits
EXTRA = "pip install 'qnn-convbwd[finetune]'"
# The torch copy's dropout masks in ``fit``: the program's, or its own.
TORCH_MASKS = ("program", "own")
# ``fit``'s optimizers, both applied inside the program (``program_optimizer``).
OPTIMIZERS = ("sgd", "adamw")


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


class ModelError(ValueError):
    """A model, checkpoint or input size that does not fit; the message says which and why."""


def user_model(spec: str, classes: int, seed: int = 0) -> nn.Module:
    """``module:function``'s model: ``function(num_classes=classes)`` from an importable
    ``module``, with torch's random state seeded by ``seed`` (the global state is left as
    it was)."""
    import importlib

    module_name, _, function_name = spec.partition(":")
    if not module_name or not function_name:
        raise ModelError(f"--model {spec!r}: expected module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ModelError(f"--model {spec!r}: cannot import {module_name!r} ({err})") from None
    build = getattr(module, function_name, None)
    if not callable(build):
        raise ModelError(f"--model {spec!r}: {module_name} has no function {function_name!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = build(num_classes=classes)
    if not isinstance(net, nn.Module):
        raise ModelError(f"--model {spec!r} returned a {type(net).__name__}, not an nn.Module")
    return net


def _listed(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def load_weights(net: nn.Module, path: str | Path) -> str | None:
    """Load a torch ``state_dict`` file into ``net`` strictly: every name and shape must
    match, except the classifier head's (``head``) when the checkpoint has another number
    of classes: then ``net`` keeps its own new head. Returns that news (``None`` when the
    head was loaded); raises ``ModelError`` listing the mismatched names otherwise. ``net``
    is unchanged when it raises."""
    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # missing, truncated or not a torch file
        raise ModelError(f"--weights {path}: not readable ({type(err).__name__}: {err})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ModelError(f"--weights {path}: not a state_dict (names to tensors)")
    own = net.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = sorted(n for n in set(own) & set(state) if own[n].shape != state[n].shape)
    top = head(net)
    head_names = {f"{top}.weight", f"{top}.bias"}
    replaced = None
    if shapes and set(shapes) <= head_names and f"{top}.weight" in shapes:
        theirs, ours = state[f"{top}.weight"].shape[0], own[f"{top}.weight"].shape[0]
        replaced = (
            f"classifier {top!r} replaced: the checkpoint has {theirs} classes, the data {ours}"
        )
        state = {n: v for n, v in state.items() if n not in head_names}
        shapes = []
    if missing or unexpected or shapes:
        problems = []
        if missing:
            problems.append(f"not in the checkpoint: {_listed(missing)}")
        if unexpected:
            problems.append(f"not in the model: {_listed(unexpected)}")
        if shapes:
            problems.append(
                "other shapes: "
                + _listed([f"{n} {tuple(state[n].shape)} vs {tuple(own[n].shape)}" for n in shapes])
            )
        raise ModelError(
            f"--weights {path} is not a checkpoint of this architecture ({type(net).__name__}): "
            + "; ".join(problems)
        )
    net.load_state_dict(state, strict=replaced is None)
    return replaced


def check_size(net: nn.Module, size: int) -> None:
    """Raise ``ModelError`` when ``net`` cannot classify ``size`` x ``size`` RGB images (one
    eval-mode pass over zeros; ``net`` is left in its mode)."""
    was_training = net.training
    try:
        with torch.no_grad():
            out = net.eval()(torch.zeros(2, 3, size, size))
    except Exception as err:  # whatever the model raises on that size
        raise ModelError(
            f"--size {size}: {type(net).__name__} cannot take {size}x{size} images "
            f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
        ) from None
    finally:
        net.train(was_training)
    if not isinstance(out, torch.Tensor) or out.dim() != 2 or len(out) != 2:
        raise ModelError(f"--size {size}: {type(net).__name__} does not return (batch, classes)")


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
    * ``head``: the head alone: every parameter of the top-level child of ``net``
      holding ``head(net)`` (the CIFAR example's two-layer ``classifier``, a ResNet's
      ``fc``); with ``adapter``, the schemes a quantized backbone takes
      (``fit(quantize=...)``, ``QUANTIZED_SCHEMES``);
    * ``adapter``: the backbone frozen; a ``ResidualAdapter`` (a zero-initialised
      1x1 convolution, residual) after each of the ``ADAPTED_BLOCKS`` blocks before
      the last one, and the head, train. Modifies ``net`` in place (the adapted
      blocks move under ``<block>.block``); ``size`` is the input size of the pass
      that finds each block's channels. On a ``quantized.QuantizedBackbone``
      quantized with its adapters left float (``quantize_for_fit``), ``adapter``
      trains those adapters and the head child and adds none.

    Frozen batch norms still normalise with the batch's statistics and update their
    running statistics in ``train()``, as in torch.
    """
    from .quantized import QuantizedBackbone

    if scheme not in SCHEMES:
        raise ValueError(f"scheme {scheme!r}: one of {', '.join(SCHEMES)}")
    names = [name for name, _ in net.named_parameters()]
    top = head(net) + "."
    if isinstance(net, QuantizedBackbone) and scheme == "adapter":
        # Quantized with its adapters left float (``quantize_for_fit``): they and the
        # head child train, as ``quantized.quantize_backbone`` set them.
        if not net.float_modules:
            raise ValueError(
                "scheme 'adapter' on a quantized backbone without adapters: apply it to the "
                "float model before quantizing (finetune.quantize_for_fit)"
            )
        inside = tuple(f"backbone.{m}." for m in net.float_modules)
        train = {n for n in names if n.startswith((net.head_name + ".", *inside))}
    elif scheme == "full":
        train = set(names)
    elif scheme == "bias-only":
        train = {n for n in names if n.endswith(".bias") or n.startswith(top)}
    elif scheme == "head":
        child = top.split(".", 1)[0] + "."
        train = {n for n in names if n.startswith(child)}
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
    seconds: float  # the program's step (one call: forward, backward and update)
    torch_seconds: float  # torch eager's step


@dataclasses.dataclass
class Evaluation:
    step: int  # steps done when evaluated
    epoch: float  # step / steps per epoch
    program_accuracy: float  # torch eager, eval(), on the program's state_dict
    torch_accuracy: float


@dataclasses.dataclass
class FitPhase:
    """One phase of a fit: its own training program and a fresh optimizer (in the program
    and for the torch copy), the weights as the previous phase left them."""

    trains: str  # "head": the head alone (a warm start); else the scheme
    first: int  # steps of the run before it
    steps: int
    optimizer: dict[str, Any]  # describe_optimizer: its name, base rate, hyper-parameters
    lr_schedule: str
    trainable: int  # trainable parameter elements
    lowering_seconds: float
    delegates: int
    on_cpu: dict[str, int]  # ops its program keeps on CPU, by partition rule


@dataclasses.dataclass
class _Planned:
    """A phase ``fit`` will run: the parameters it trains (names), its optimizer, where it
    starts in the run and its learning-rate schedule."""

    trains: str
    names: list[str]
    optimizer: Any  # training.SGD / training.AdamW
    first: int
    steps: int
    schedule: str

    def rate(self, step: int) -> float:
        """The learning rate of the phase's step ``step`` (0-based)."""
        return self.optimizer.lr * lr_factor(self.schedule, step, self.steps)

    def describe(self) -> dict[str, Any]:
        return {
            "trains": self.trains,
            "first": self.first,
            "steps": self.steps,
            "optimizer": describe_optimizer(self.optimizer),
            "lr_schedule": self.schedule,
        }


def _warm_start(net: nn.Module, scheme: str, steps: int, optimizer: Any) -> _Planned:
    """The head-alone phase before ``scheme``: the parameters ``scheme`` trains inside the
    top-level child holding the head (``apply_scheme``'s ``head``)."""
    child = head(net).split(".", 1)[0] + "."
    names = [n for n in trainable_names(net) if n.startswith(child)]
    if not names:
        raise ValueError(
            f"scheme {scheme!r} trains nothing in the head {child[:-1]!r}: there is no head "
            "to warm up (head_epochs 0)"
        )
    return _Planned("head", names, optimizer, 0, steps, "none")


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
    torch_reference: bool = True  # False: no torch copy trained (its losses are NaN)
    # The lowered training program (training.TrainingProgram) and its state after the
    # last step by program names (session.program_state(): TrainingProgram.emit).
    program: Any = dataclasses.field(default=None, repr=False)
    program_final: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict, repr=False)
    # The optimizer the program applies and the torch copy uses: its name ("sgd",
    # "adamw"), learning rate and hyper-parameters (``describe_optimizer``).
    optimizer: dict[str, Any] = dataclasses.field(default_factory=dict)
    # A quantized backbone's scheme, calibration and digest (``quantize_for_fit``).
    quantization: dict[str, Any] | None = None
    # The trained model in eval(), the program's state loaded (a quantized run's
    # ``quantized.QuantizedBackbone``).
    trained: Any = dataclasses.field(default=None, repr=False)
    # The phases that ran, in order: the head alone first with ``head_epochs``, then the
    # scheme. ``program``, ``delegates`` and ``on_cpu`` are the last phase's,
    # ``lowering_seconds`` the sum of the lowerings this process made.
    phases: list[FitPhase] = dataclasses.field(default_factory=list)

    def _timed(self) -> list[Step]:
        """The steps after each phase's first (which loads its program's delegates); the
        first ones when there are no others."""
        firsts = {phase.first for phase in self.phases} | {0}
        return [s for i, s in enumerate(self.steps) if i not in firsts] or self.steps

    @property
    def mean_step_seconds(self) -> float:
        """Mean seconds of the program's steps after each phase's first (which loads the
        delegates); the first ones alone when there are no others."""
        timed = self._timed()
        return sum(s.seconds for s in timed) / len(timed) if timed else math.nan

    @property
    def mean_torch_step_seconds(self) -> float:
        timed = self._timed()
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
            "torch": self.torch_reference,
        }
        script = Path(__file__).with_name("fit_plot.py")
        done = subprocess.run(
            [sys.executable, str(script)], input=json.dumps(data), capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(f"plotting failed: {done.stderr[-1000:]}")
        return path


LR_SCHEDULES = ("none", "cosine", "step")


def lr_factor(schedule: str, step: int, total: int) -> float:
    """The learning rate of step ``step`` (0-based) of ``total`` as a multiple of the base
    rate: ``none`` 1; ``cosine`` from 1 down along half a cosine (0 after the last step);
    ``step`` 1, then 0.1 from half-way, 0.01 from three quarters of the steps."""
    if schedule == "none":
        return 1.0
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * step / total))
    if schedule == "step":
        milestones = (max(1, total // 2), max(1, (3 * total) // 4))
        return 0.1 ** sum(step >= m for m in milestones)
    raise ValueError(f"lr schedule {schedule!r}: one of {', '.join(LR_SCHEDULES)}")


def program_optimizer(
    optimizer: str, lr: float, momentum: float | None = None, weight_decay: float | None = None
) -> Any:
    """The optimizer of a fine-tuning run, chosen here for both sides: the program applies
    it itself (``training.SGD`` or ``training.AdamW``, passed to ``lower_for_training``)
    and the torch copy steps with the same ``torch.optim`` optimizer (its
    ``torch_optimizer``). ``sgd``: momentum (default 0) and L2 weight decay (default 0);
    ``adamw``: torch's betas (0.9, 0.999) and eps 1e-8, decoupled weight decay (default
    torch's 0.01); it takes no momentum."""
    from . import training

    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r}: one of {', '.join(OPTIMIZERS)}")
    if optimizer == "sgd":
        return training.SGD(lr, momentum=momentum or 0.0, weight_decay=weight_decay or 0.0)
    if momentum:
        raise ValueError(f"momentum {momentum:g} is SGD's: the adamw optimizer takes none")
    if weight_decay is None:
        return training.AdamW(lr)
    return training.AdamW(lr, weight_decay=weight_decay)


def describe_optimizer(optimizer: Any) -> dict[str, Any]:
    """The optimizer's kind and hyper-parameters, JSON-able (``report.json``,
    checkpoints)."""
    settings = dataclasses.asdict(optimizer)
    if "betas" in settings:
        settings["betas"] = list(settings["betas"])
    return {"name": type(optimizer).__name__.lower(), **settings}


CHECKPOINT_FORMAT = "qnn-convbwd finetune checkpoint 3"
# The head-alone warm start's learning rate (``fit(head_epochs=...)``), and the rate of
# adapters inside a quantized backbone after it: the domain-shift study's protocol
# (docs/quantized.md: adapters trained from the first step take the gradients of a
# confidently wrong head and pull the backbone's features off).
HEAD_LR = 0.02
ADAPTER_LR = 0.005


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
    momentum: float | None = None,
    weight_decay: float | None = None,
    optimizer: str = "sgd",
    seed: int = 0,
    cpu_only: bool = False,
    train_mode: bool = True,
    torch_masks: str = "program",
    eval_every: int | None = None,
    on_progress: Callable[[FitResult, int, Evaluation | None], None] | None = None,
    torch_reference: bool = True,
    lr_schedule: str = "none",
    checkpoint_every: int | None = None,
    on_checkpoint: Callable[[dict], None] | None = None,
    resume: dict | None = None,
    external_weights: bool = False,
    quantize: str | None = None,
    calibration_batches: int = CALIBRATION_BATCHES,
    torch_start: dict[str, torch.Tensor] | None = None,
    head_epochs: int = 0,
    head_lr: float = HEAD_LR,
    head_momentum: float | None = None,
) -> FitResult:
    """Train a copy of ``model`` (cross-entropy) through the lowered program and, on the
    same batches, an fp32 eager copy; both from the same weights, both with
    ``program_optimizer(optimizer, lr, momentum, weight_decay)`` at ``lr`` times
    ``lr_factor(lr_schedule, ...)``. The program applies the optimizer itself: each step
    is one call of its ``forward`` (forward, backward, update), the schedule setting the
    program's learning rate (``session.lr``) before it; the torch copy steps with the
    same ``torch.optim`` optimizer.

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
    ``torch_reference=False`` trains the program alone. ``torch_start`` is a state
    dict the torch copy starts from instead of ``model``'s (with ``apply_scheme`` and
    ``quantize`` done): a run that goes on from an earlier one, the program from the
    earlier program's weights (``model``) and torch from the earlier torch copy's
    (``FitResult.torch_state``).

    Both are evaluated before the first step, every ``eval_every`` steps (default:
    each epoch) and after the last: the program's accuracy is an eager copy's in
    ``eval()`` after ``load_state_dict(session.state_dict())``, so its running
    statistics count. ``cpu_only`` lowers the same joint graph for SM8350 (HTP V68),
    where the partition rules keep a training graph on CPU as a whole: no delegate,
    for comparing step times. ``on_progress(result, total, evaluation)`` is called
    before the first step and after every step with the result so far (its
    ``steps`` done of ``total``) and the evaluation made at that step, if any.

    ``on_checkpoint(state)`` is called every ``checkpoint_every`` steps (default: each
    epoch) before the last with everything the run carries from step to step: every
    tensor the program keeps (``session.program_state()``: parameters, updated buffers,
    the optimizer's state, step count and learning rate, the dropout step counter), the
    program's optimizer state in ``torch.optim``'s format too, the torch copy and its
    optimizer, torch's random state and the steps and evaluations so far. ``resume`` is
    such a state: the run goes on from its step, and its remaining steps compute what an
    uninterrupted run computes. ``external_weights`` lowers a program whose weights live
    in a ``.ptd`` (``FitResult.program.ptd``).

    ``quantize`` (``"8a8w"`` or ``"16a8w"``, ``quantized.SCHEMES``) quantizes the
    backbone with executorch's ``QnnQuantizer`` after calibration on
    ``calibration_batches`` batches of the training data (``calibration_data``) and
    keeps the head float (``quantized.quantize_backbone``): the head trains
    (``scheme="head"``), or float adapters inside the backbone and the head
    (``scheme="adapter"``); another scheme is refused. The torch copy runs the same
    converted backbone in fp32. A checkpoint holds the converted backbone's digest;
    a resume quantizes again and is refused when the digest differs.

    ``head_epochs`` > 0 runs a warm start first: that many epochs of the head alone
    (the parameters ``scheme`` trains inside the top-level child holding the last
    ``nn.Linear``) with the same kind of optimizer at ``head_lr``, momentum
    ``head_momentum`` (default ``momentum``), no schedule; then ``steps`` or ``epochs``
    of ``scheme`` as above. Each phase has a training program of its own, lowered from
    the weights the previous phase left, and a fresh optimizer (in the program and for
    the torch copy, which goes on from its own weights); each takes its batches from
    the first epoch's shuffle on, as a run of its own would, and the dropout masks go
    on from the previous phase's draws. Steps, evaluations (also after each phase) and
    checkpoints count over the whole run (``FitResult.phases`` says where each phase
    starts); a checkpoint is also written when a phase after the first starts, and a
    resume goes on in the phase its checkpoint was written in. This is the protocol of
    adapters inside a quantized backbone (``HEAD_LR``, ``ADAPTER_LR``): trained from
    the first step they take the gradients of a confidently wrong head.
    """
    from . import quantized, training
    from .api import enabled
    from .passes import dropout
    from .toolchain import harness

    if steps is not None and epochs is not None:
        raise ValueError("give steps or epochs, not both")
    if torch_masks not in TORCH_MASKS:
        raise ValueError(f"torch_masks={torch_masks!r}: one of {', '.join(TORCH_MASKS)}")
    if lr_schedule not in LR_SCHEDULES:
        raise ValueError(f"lr schedule {lr_schedule!r}: one of {', '.join(LR_SCHEDULES)}")
    if head_epochs < 0:
        raise ValueError(f"head_epochs={head_epochs}: 0 or more")
    if head_epochs and scheme == "head":
        raise ValueError("head_epochs with scheme 'head': it trains the head alone already")
    chosen = program_optimizer(optimizer, lr, momentum, weight_decay)
    described = describe_optimizer(chosen)
    head_optimizer = (
        program_optimizer(
            optimizer, head_lr, momentum if head_momentum is None else head_momentum, weight_decay
        )
        if head_epochs
        else None
    )
    if quantize is not None:
        check_quantized_scheme(scheme, quantize)
    net = apply_scheme(copy.deepcopy(model), scheme)
    quantization = None
    if quantize is not None:
        net, quantization = quantize_for_fit(net, train, batch, quantize, calibration_batches, seed)
    if resume is not None and resume.get("quantization") != quantization:
        raise QuantizationMismatch(
            "the checkpoint is of a run whose quantized backbone differs from the one "
            f"built now ({resume.get('quantization')} vs {quantization})"
        )
    net.train(train_mode)
    trainable = trainable_names(net)
    if not trainable:
        raise ValueError(f"scheme {scheme!r} leaves nothing to train")
    per_epoch = _steps_per_epoch(train, batch)
    if per_epoch == 0:
        raise ValueError(f"no batch of {batch} samples in the training data")
    plan = [
        _Planned(
            scheme,
            trainable,
            chosen,
            head_epochs * per_epoch,
            steps if steps is not None else per_epoch * (epochs or 1),
            lr_schedule,
        )
    ]
    if head_epochs:
        plan.insert(0, _warm_start(net, scheme, head_epochs * per_epoch, head_optimizer))
    total = plan[-1].first + plan[-1].steps
    eval_every = eval_every or per_epoch
    checkpoint_every = checkpoint_every or per_epoch
    dropped = 0 if isinstance(train, torch.utils.data.DataLoader) else len(train[0]) % batch
    if resume is not None and (
        resume.get("format") != CHECKPOINT_FORMAT or resume["total"] != total
    ):
        raise ValueError(
            f"the checkpoint is of a run of {resume.get('total')} steps, not {total} "
            f"(or not a checkpoint of {CHECKPOINT_FORMAT!r})"
        )
    if resume is not None and resume.get("optimizer") != described:
        raise ValueError(
            f"the checkpoint is of a run with the optimizer {resume.get('optimizer')}, "
            f"not {described}"
        )
    planned = [p.describe() for p in plan]
    if resume is not None and resume.get("plan") != planned:
        raise ValueError(
            f"the checkpoint is of a run with the phases {resume.get('plan')}, not {planned}"
        )

    reference = copy.deepcopy(net) if torch_reference else None
    if reference is not None and torch_start is not None:
        reference.load_state_dict(torch_start)
    if reference is not None and quantized.holds_activation_pairs(reference):
        # The gradients of adapters inside a quantized backbone pass its quantizes as in
        # the program: by the straight-through estimator (the same forward values).
        quantized.straight_through(reference)
    loss = nn.CrossEntropyLoss()
    first = next(_batches(train, batch, seed))
    target_soc = "SM8350" if cpu_only else soc
    result = FitResult(
        name=type(model).__name__,
        scheme=scheme,
        soc=target_soc,
        cpu_only=cpu_only,
        train_mode=train_mode,
        batch=batch,
        lr=lr,
        trainable=sum(p.numel() for p in net.parameters() if p.requires_grad),
        lowering_seconds=0.0,
        delegates=0,
        on_cpu=[],
        dropped_per_epoch=dropped,
        torch_reference=torch_reference,
        optimizer=described,
        quantization=quantization,
    )
    evaluated = copy.deepcopy(net)
    start_step, start_phase = 0, 0
    if resume is not None:
        start_step, start_phase = resume["step"], resume["phase"]
        if reference is not None and resume.get("reference_state") is None:
            raise ValueError("the checkpoint has no torch copy (a run without torch)")
        result.steps = [Step(**s) for s in resume["steps"]]
        result.evaluations = [Evaluation(**e) for e in resume["evaluations"]]
        result.phases = [FitPhase(**p) for p in resume["phases"]]

    def lower(phase: _Planned) -> tuple[Any, list]:
        """The phase's training program, lowered from ``net`` as it is, and the dropout
        sites the torch copy recomputes its masks from."""
        for name, parameter in net.named_parameters():
            parameter.requires_grad_(name in phase.names)
        wrapped = training.WithLoss(copy.deepcopy(net), loss)
        # Lowering leaves the run's random state (torch's own dropout masks) as it was.
        with torch.random.fork_rng(devices=[]), enabled(dropout_seed=seed):
            program = training.lower_for_training(
                wrapped,
                first,
                harness.compile_specs(target_soc),
                external_weights=external_weights,
                optimizer=phase.optimizer,
            )
        sites: list[dropout.Site] = []
        if (
            reference is not None
            and train_mode
            and torch_masks == "program"
            # A program that draws keeps the draws' step counter; one without has no
            # draws to recompute, and the export below is skipped.
            and dropout.STEP_BUFFER in training.program_buffers(program.pte)
        ):
            # The program's draws, recomputed from the seed: the joint graph, rewritten
            # (a quantized model's with the estimator, as lower_for_training exports it).
            exported = wrapped
            if quantized.holds_activation_pairs(wrapped):
                exported = copy.deepcopy(wrapped)
                quantized.straight_through(exported)
            with torch.random.fork_rng(devices=[]):
                _, sites = dropout.rewrite(training.export_joint(exported, first), seed)
        return program, sites

    def evaluate(done: int) -> Evaluation:
        evaluated.load_state_dict(session.state_dict())
        found = Evaluation(
            done,
            done / per_epoch,
            accuracy(evaluated, test),
            accuracy(reference, test) if reference is not None else math.nan,
        )
        result.evaluations.append(found)
        return found

    def state(done: int, index: int, optimizer: Any) -> dict:
        return {
            "format": CHECKPOINT_FORMAT,
            "step": done,
            "total": total,
            "phase": index,
            "plan": planned,
            "optimizer": described,
            "program_state": session.program_state(),
            "program_optimizer": session.optimizer_state_dict(),
            "reference_state": None
            if reference is None
            else {k: v.detach().clone() for k, v in reference.state_dict().items()},
            "reference_optimizer": None
            if optimizer is None
            else copy.deepcopy(optimizer.state_dict()),
            "rng": torch.get_rng_state(),
            "quantization": quantization,
            "steps": [dataclasses.asdict(s) for s in result.steps],
            "evaluations": [dataclasses.asdict(e) for e in result.evaluations],
            "phases": [dataclasses.asdict(p) for p in result.phases],
        }

    session = None
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # torch's own dropout masks (torch_masks="own")
            for index in range(start_phase, len(plan)):
                phase = plan[index]
                resumed = resume is not None and index == start_phase
                program, sites = lower(phase)
                delegates = harness.delegate_count(program.edge)
                if cpu_only and delegates:
                    raise RuntimeError(f"the CPU-only program has {delegates} delegate(s)")
                result.program, result.delegates = program, delegates
                result.on_cpu = list(program.report.on_cpu)
                result.lowering_seconds += program.lowering_seconds
                reference_optimizer = None
                if reference is not None:
                    for name, parameter in reference.named_parameters():
                        parameter.requires_grad_(name in phase.names)
                    reference_optimizer = phase.optimizer.torch_optimizer(
                        [p for p in reference.parameters() if p.requires_grad]
                    )
                session = program.session()
                if resumed:
                    session.load_program_state(resume["program_state"])
                    if reference is not None:
                        reference.load_state_dict(resume["reference_state"])
                        reference_optimizer.load_state_dict(resume["reference_optimizer"])
                else:
                    record = FitPhase(
                        trains=phase.trains,
                        first=phase.first,
                        steps=phase.steps,
                        optimizer=describe_optimizer(phase.optimizer),
                        lr_schedule=phase.schedule,
                        trainable=sum(
                            p.numel() for n, p in net.named_parameters() if n in phase.names
                        ),
                        lowering_seconds=program.lowering_seconds,
                        delegates=delegates,
                        on_cpu=dict(collections.Counter(op.rule for op in program.report.on_cpu)),
                    )
                    result.phases.append(record)
                    if index > 0:
                        # The dropout masks go on from the previous phase's draws.
                        carried = session.program_state()
                        if dropout.STEP_BUFFER in carried:
                            carried[dropout.STEP_BUFFER].fill_(phase.first)
                            session.load_program_state(carried)

                if resumed:
                    torch.set_rng_state(resume["rng"])
                    evaluation = None
                elif index == 0:
                    evaluation = evaluate(0)
                else:
                    evaluation = None
                    if on_checkpoint is not None:
                        # A crash from here on resumes in this phase.
                        on_checkpoint(state(phase.first, index, reference_optimizer))
                if on_progress is not None and (index == 0 or resumed):
                    on_progress(result, total, evaluation)
                start = start_step - phase.first if resumed else 0
                end = phase.first + phase.steps
                batches = itertools.islice(_batches(train, batch, seed), start, None)
                for done in range(phase.first + start + 1, end + 1):
                    x, y = next(batches)
                    rate = phase.rate(done - phase.first - 1)
                    session.lr = rate
                    begun = time.perf_counter()
                    program_loss = session.step([x, y])
                    seconds = time.perf_counter() - begun
                    torch_loss, torch_seconds = math.nan, math.nan
                    if reference is not None:
                        begun = time.perf_counter()
                        reference_optimizer.zero_grad(set_to_none=True)
                        if sites:
                            with dropout.ProgramMasks(sites, done - 1):
                                reference_loss = loss(reference(x), y)
                        else:
                            reference_loss = loss(reference(x), y)
                        reference_loss.backward()
                        for group in reference_optimizer.param_groups:
                            group["lr"] = rate
                        reference_optimizer.step()
                        torch_seconds = time.perf_counter() - begun
                        torch_loss = float(reference_loss.detach())
                    result.steps.append(Step(program_loss, torch_loss, seconds, torch_seconds))
                    evaluation = evaluate(done) if done % eval_every == 0 or done == end else None
                    if on_progress is not None:
                        on_progress(result, total, evaluation)
                    if on_checkpoint is not None and done % checkpoint_every == 0 and done < end:
                        on_checkpoint(state(done, index, reference_optimizer))
                net.load_state_dict(session.state_dict())
                if index < len(plan) - 1:
                    session.close()
                    session = None
        result.program_state = session.state_dict()
        result.program_final = session.program_state()
        evaluated.load_state_dict(result.program_state)
        result.trained = evaluated.eval()
        if reference is not None:
            result.torch_state = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    finally:
        if session is not None:
            session.close()
    return result


class QuantizationMismatch(ValueError):
    """A resumed run whose quantized backbone, built again, differs from the checkpoint's."""


def check_quantized_scheme(scheme: str, quantize: str) -> None:
    """Raise ``ValueError`` unless ``scheme`` is one a quantized backbone takes
    (``QUANTIZED_SCHEMES``: the head, or adapters left float inside the backbone and the
    head)."""
    from . import quantized

    if quantize not in quantized.SCHEMES:
        raise ValueError(f"quantization {quantize!r}: one of {', '.join(quantized.SCHEMES)}")
    if scheme not in QUANTIZED_SCHEMES:
        raise ValueError(
            f"scheme {scheme!r} with a quantized backbone ({quantize}): {scheme!r} trains "
            "quantized weights; a quantized backbone takes "
            f"{' or '.join(repr(s) for s in QUANTIZED_SCHEMES)}"
        )


def calibration_data(
    train: Any, batch: int, count: int, seed: int
) -> tuple[list[torch.Tensor], list[int] | None]:
    """``count`` batches of ``batch`` training images to calibrate a quantized backbone on,
    and the indices of those images: tensor data drawn by a permutation from ``seed``
    (the first ``count * batch`` of it; fewer batches when the data is smaller), a
    ``DataLoader``'s first ``count`` batches of ``batch`` samples (indices ``None``)."""
    if count <= 0:
        raise ValueError(f"calibration batches: {count}, at least 1 is needed")
    if isinstance(train, torch.utils.data.DataLoader):
        found = [x for x, _ in itertools.islice(_epoch_batches(train, batch, None), count)]
        return found, None
    x, _ = train
    generator = torch.Generator().manual_seed(seed * 1_000_003 + 7919)
    order = torch.randperm(len(x), generator=generator)
    usable = min(count, len(x) // batch) * batch
    chosen = order[:usable]
    return [x[chosen[i : i + batch]] for i in range(0, usable, batch)], chosen.tolist()


def quantize_for_fit(
    net: nn.Module, train: Any, batch: int, scheme: str, count: int, seed: int
) -> tuple[nn.Module, dict[str, Any]]:
    """A copy of ``net`` with its backbone quantized in ``eval()``
    (``quantized.quantize_backbone``; the head keeps ``net``'s mode) on
    ``calibration_data(train, batch, count, seed)``, and what a checkpoint keeps of it:
    the quantization, the batches used, a digest of the calibration images and of the
    converted backbone (``quantized.digest``)."""
    from . import quantized

    batches, _ = calibration_data(train, batch, count, seed)
    if not batches:
        raise ValueError(f"no calibration batch of {batch} samples in the training data")
    was_training = net.training
    # ``apply_scheme(net, "adapter")``'s adapters stay float and train inside the backbone.
    adapters = [f"{n}.adapter" for n, m in net.named_modules() if isinstance(m, ResidualAdapter)]
    try:
        quantized_net = quantized.quantize_backbone(
            net.eval(), head(net), scheme, batches, float_modules=adapters
        )
    finally:
        net.train(was_training)
    quantized_net.train(was_training)
    images = hashlib.sha256()
    for tensor in batches:
        images.update(tensor.contiguous().numpy().tobytes())
    return quantized_net, {
        "scheme": scheme,
        "calibration_batches": len(batches),
        "calibration_digest": images.hexdigest(),
        "backbone_digest": quantized.digest(quantized_net),
    }


def trained_program(result: FitResult) -> tuple[bytes, bytes | None]:
    """The ``.pte`` (and ``.ptd``) of ``result``'s training program starting where the run
    ended: every tensor it keeps as after the last step (parameters, running
    statistics, the optimizer's state and step count, the dropout step counter), except
    the learning rate, which is the run's base rate (``result.lr``; the schedule is the
    caller's). No delegate is lowered again (``TrainingProgram.emit``)."""
    from .passes import optimizer as optimizer_pass

    state = dict(result.program_final)
    state[optimizer_pass.LR_BUFFER] = torch.tensor([float(result.lr)], dtype=torch.float64)
    return result.program.emit(state)


def _batches(data: Any, batch: int, seed: int) -> Iterator[tuple]:
    """Batches of exactly ``batch`` samples, epoch after epoch."""
    epoch = 0
    while True:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        yield from _epoch_batches(data, batch, generator)
        epoch += 1


# --- outputs --------------------------------------------------------------------------

CHECKPOINT_FILE = "checkpoint.pt"
# Every file a run writes under its output folder.
RUN_FILES = (
    "model.pt",
    "train.pte",
    "train.ptd",
    "infer.pte",
    "report.json",
    "curves.png",
    CHECKPOINT_FILE,
)


def write_atomic(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file beside it and ``os.replace``: a
    crash leaves the old file or the new one, never part of one."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def save_atomic(path: str | Path, value: Any) -> None:
    """``torch.save(value)`` to ``path``, atomically (``write_atomic``)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    write_atomic(path, buffer.getvalue())


def plot_atomic(result: FitResult, path: str | Path) -> Path:
    """``result.plot`` to a temporary PNG beside ``path``, then ``os.replace``."""
    path = Path(path)
    temporary = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        result.plot(temporary)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return path


@dataclasses.dataclass
class Inference:
    pte: bytes
    delegates: int
    lowering_seconds: float


def lower_inference(net: nn.Module, example: torch.Tensor, soc: str) -> Inference:
    """``net`` in ``eval()`` lowered for ``soc``'s HTP with executorch's
    ``to_edge_transform_and_lower`` and ``QnnPartitioner`` (through
    ``harness.lower_module``), the plugin enabled; ``example`` fixes the input shape."""
    from .api import enabled
    from .toolchain import harness

    net = copy.deepcopy(net).eval()
    with enabled():
        compiled = harness.lower_module(net, (example,), soc)
    return Inference(
        bytes(compiled.pte), harness.delegate_count(compiled.edge), compiled.lower_seconds
    )
