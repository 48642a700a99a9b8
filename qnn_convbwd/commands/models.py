"""The models ``qnn-convbwd demo`` and ``qnn-convbwd train`` train (random weights, no
downloads).

Each MSE model is a frozen (or trainable) convolution stack behind a trainable 1x1
adapter (``AdapterNet``); ``cifar_case`` is ExecuTorch's own CIFAR-10 example with a
cross-entropy loss. A ``TrainingCase`` exports its joint graph with
``qnn_convbwd.training.export_joint``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn


class BasicBlock(nn.Module):
    """ResNet basic block; ``stride`` 2 adds a 1x1 downsample on the shortcut."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.down = nn.Conv2d(cin, cout, 1, stride=stride) if stride != 1 or cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.down is None else self.down(x)
        return torch.relu(self.conv2(torch.relu(self.conv1(x))) + shortcut)


class InvertedResidual(nn.Module):
    """MobileNetV2 block: 1x1 expand, 3x3 depthwise (stride), 1x1 project."""

    def __init__(self, cin: int, cout: int, stride: int = 1, expand: int = 4) -> None:
        super().__init__()
        hidden = cin * expand
        self.expand = nn.Conv2d(cin, hidden, 1)
        self.depthwise = nn.Conv2d(hidden, hidden, 3, stride=stride, padding=1, groups=hidden)
        self.project = nn.Conv2d(hidden, cout, 1)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.project(torch.relu(self.depthwise(torch.relu(self.expand(x)))))
        return x + y if self.residual else y


class AdapterNet(nn.Module):
    """Trainable 1x1 adapter in front of a backbone; MSE loss against a target."""

    def __init__(self, channels: int, backbone: nn.Module, trainable_backbone: bool) -> None:
        super().__init__()
        self.adapter = nn.Conv2d(channels, channels, 1)
        self.backbone = backbone
        self.backbone.requires_grad_(trainable_backbone)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.backbone(self.adapter(x)), target)


def resnet_like(channels: int = 8, depth: int = 1) -> nn.Module:
    """``depth`` stages of (stride-2 block, stride-1 block)."""
    layers: list[nn.Module] = []
    c = channels
    for _ in range(depth):
        layers += [BasicBlock(c, 2 * c, stride=2), BasicBlock(2 * c, 2 * c)]
        c *= 2
    return nn.Sequential(*layers)


def mobilenet_like(channels: int = 8, depth: int = 1) -> nn.Module:
    layers: list[nn.Module] = []
    c = channels
    for _ in range(depth):
        layers += [InvertedResidual(c, 2 * c, stride=2), InvertedResidual(2 * c, 2 * c)]
        c *= 2
    return nn.Sequential(*layers)


def demo_backbone(channels: int = 8) -> nn.Module:
    """What ``qnn-convbwd demo`` trains through: plain, strided (odd size) and depthwise convs."""
    return nn.Sequential(
        nn.Conv2d(channels, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1, groups=16),
        nn.ReLU(),
        nn.Conv2d(16, 8, 1),
    )


def linear_backbone(channels: int = 8) -> nn.Module:
    """Convolutions only, no activation: its backward has no relu mask (le/where)."""
    return nn.Sequential(
        nn.Conv2d(channels, channels, 3, padding=1),
        nn.Conv2d(channels, 2 * channels, 3, stride=2, padding=1),
    )


BACKBONES: dict[str, Callable[..., nn.Module]] = {
    "linear": linear_backbone,
    "demo": demo_backbone,
    "resnet": resnet_like,
    "mobilenet": mobilenet_like,
    "basic_block": lambda channels=8: BasicBlock(channels, channels),
    "stride2_block": lambda channels=8: BasicBlock(channels, 2 * channels, stride=2),
}


def reference_model(
    backbone: str = "demo",
    size: int = 15,
    batch: int = 1,
    channels: int = 8,
    trainable_backbone: bool = False,
    seed: int = 0,
    **backbone_args,
) -> tuple[str, AdapterNet, tuple[torch.Tensor, torch.Tensor]]:
    """One reference model, its inputs and its name, not exported (``training_graph``)."""
    torch.manual_seed(seed)
    model = AdapterNet(
        channels, BACKBONES[backbone](channels=channels, **backbone_args), trainable_backbone
    )
    x = torch.randn(batch, channels, size, size)
    with torch.no_grad():
        target = torch.randn_like(model.backbone(model.adapter(x)))
    name = f"{backbone}-{size}px-{'trainable' if trainable_backbone else 'frozen'}"
    return name, model, (x, target)


# --- classifiers trained with cross-entropy (ExecuTorch's CIFAR example) -----------------


class CrossEntropyTraining(nn.Module):
    """``forward(x, labels)`` returns the cross-entropy loss of ``classifier(adapter(x))``.

    ``adapter`` is a trainable 1x1 convolution (near the identity) in front of
    the classifier when given: the frozen-backbone scheme.
    """

    def __init__(self, classifier: nn.Module, adapter: nn.Module | None = None) -> None:
        super().__init__()
        self.adapter = adapter
        self.classifier = classifier

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.adapter is not None:
            x = self.adapter(x)
        return nn.functional.cross_entropy(self.classifier(x), labels)


def identity_adapter(channels: int, generator: torch.Generator) -> nn.Conv2d:
    """A 1x1 convolution close to the identity (so a frozen backbone sees its usual input)."""
    adapter = nn.Conv2d(channels, channels, 1)
    with torch.no_grad():
        noise = 0.05 * torch.randn(channels, channels, 1, 1, generator=generator)
        adapter.weight.copy_(torch.eye(channels).view(channels, channels, 1, 1) + noise)
        adapter.bias.zero_()
    return adapter


@dataclasses.dataclass
class TrainingCase:
    name: str
    model: nn.Module  # forward(*inputs) -> loss
    inputs: tuple[torch.Tensor, ...]

    def joint(self) -> torch.export.ExportedProgram:
        from ..training import export_joint

        return export_joint(self.model, self.inputs)


def cifar_case(trainable: bool, batch: int = 4, size: int = 32, seed: int = 0) -> TrainingCase:
    """ExecuTorch's own CIFAR-10 example model (dropout off), cross-entropy loss.

    ``trainable=False``: ``features`` frozen behind a trainable 1x1 adapter, the
    classifier head trainable.
    """
    from executorch.extension.training.examples.CIFAR.model import CIFAR10Model

    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    net = CIFAR10Model().eval()  # eval: dropout off, for a deterministic step
    adapter = None
    if not trainable:
        net.features.requires_grad_(False)
        adapter = identity_adapter(3, generator)
    model = CrossEntropyTraining(net, adapter)
    x = torch.randn(batch, 3, size, size, generator=generator)
    labels = torch.randint(0, 10, (batch,), generator=generator)
    scheme = "trainable" if trainable else "frozen"
    return TrainingCase(f"cifar-{size}px-{scheme}", model, (x, labels))


def adapter_case(
    backbone: str = "demo", trainable: bool = False, size: int = 15, **kwargs
) -> TrainingCase:
    """The MSE reference models of ``training_graph`` as a TrainingCase (exported by
    ``TrainingCase.joint``, not here)."""
    name, model, inputs = reference_model(
        backbone, size=size, trainable_backbone=trainable, **kwargs
    )
    return TrainingCase(name, model, inputs)


TRAINING_MODELS: dict[str, Callable[..., TrainingCase]] = {
    "cifar": lambda trainable, **kw: cifar_case(trainable, **kw),
    "demo": lambda trainable, **kw: adapter_case("demo", trainable, **kw),
    "resnet": lambda trainable, **kw: adapter_case("resnet", trainable, size=16, **kw),
    "mobilenet": lambda trainable, **kw: adapter_case("mobilenet", trainable, size=16, **kw),
}
