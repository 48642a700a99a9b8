"""MobileNet-like models with batch norm, for the numerics checks (docs/numerics.md).

conv-BN-ReLU6 blocks, a stride-2 depthwise conv, squeeze-excitation with
hardsigmoid, a wide 1x1 projection and residual adds, down to 2x2 and 1x1
spatial: the shapes at which executorch's QNN batch norm was measured wrong.
Random weights; ``calibrate`` gives the batch norms running statistics of
random data (the defaults, mean 0 and variance 1, give degenerate activations).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from . import reference_kernels


class ConvBN(nn.Sequential):
    def __init__(
        self, cin: int, cout: int, kernel: int = 1, stride: int = 1, groups: int = 1, act=True
    ) -> None:
        layers: list[nn.Module] = [
            nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False),
            nn.BatchNorm2d(cout),
        ]
        if act:
            layers.append(nn.ReLU6())
        super().__init__(*layers)


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, squeeze: int) -> None:
        super().__init__()
        self.reduce = nn.Conv2d(channels, squeeze, 1)
        self.expand = nn.Conv2d(squeeze, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.mean((2, 3), keepdim=True)
        return x * nn.functional.hardsigmoid(self.expand(torch.relu(self.reduce(s))))


class MobileBlock(nn.Module):
    """1x1 expand, 3x3 depthwise (stride), optional squeeze-excitation, 1x1 project."""

    def __init__(self, cin: int, hidden: int, cout: int, stride: int, se: bool) -> None:
        super().__init__()
        self.expand = ConvBN(cin, hidden)
        self.depthwise = ConvBN(hidden, hidden, 3, stride, groups=hidden)
        self.se = SqueezeExcite(hidden, max(hidden // 4, 8)) if se else nn.Identity()
        self.project = ConvBN(hidden, cout, act=False)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.project(self.se(self.depthwise(self.expand(x))))
        return x + y if self.residual else y


def mobilenet_bn(channels: int = 16) -> nn.Module:
    """An 8x8 input goes 4x4 (stem), 2x2, 1x1, 1x1 (residual), then 960 -> 160 at 1x1."""
    return nn.Sequential(
        ConvBN(3, channels, 3, stride=2),
        MobileBlock(channels, 4 * channels, 24, stride=2, se=False),
        MobileBlock(24, 96, 40, stride=2, se=True),
        MobileBlock(40, 240, 40, stride=1, se=True),
        ConvBN(40, 960),
        ConvBN(960, 160, act=False),
    )


def calibrate(model: nn.Module, shape: tuple[int, ...], passes: int = 4, seed: int = 0) -> None:
    """Running statistics of ``passes`` random batches (cumulative average), then eval().

    With torch's CPU kernels pinned (``reference_kernels.pinned``): the statistics do
    not depend on whether a lowering ran earlier in the process.
    """
    generator = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.reset_running_stats()
            module.momentum = None
    model.train()
    with torch.no_grad(), reference_kernels.pinned():
        for _ in range(passes):
            model(torch.randn(shape, generator=generator))
    model.eval()


class BiasOnly(nn.Module):
    """MSE loss of a backbone in which only the batch norms' affine parameters train."""

    def __init__(self, backbone: nn.Module, train: str = "bias") -> None:
        super().__init__()
        self.backbone = backbone
        for name, param in backbone.named_parameters():
            kind = name.rsplit(".", 1)[1]  # "weight" or "bias"
            trains = _is_bn_param(backbone, name) and train in ("affine", kind)
            param.requires_grad_(trains)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.backbone(x), target)


def _is_bn_param(root: nn.Module, name: str) -> bool:
    owner = root.get_submodule(name.rsplit(".", 1)[0])
    return isinstance(owner, nn.BatchNorm2d)


@dataclasses.dataclass
class Graph:
    model: nn.Module
    inputs: tuple[torch.Tensor, torch.Tensor]
    program: torch.export.ExportedProgram  # joint forward-backward graph


def bn_training_graph(size: int = 8, train: str = "bias", seed: int = 0, backbone_fn=None) -> Graph:
    """Joint graph of ``mobilenet_bn`` (or ``backbone_fn()``) in eval mode; its BN
    ``bias`` (or ``affine``) trains."""
    from torch.export.experimental import _export_forward_backward

    torch.manual_seed(seed)
    backbone = (backbone_fn or mobilenet_bn)()
    calibrate(backbone, (4, 3, size, size), seed=seed)
    model = BiasOnly(backbone, train)
    x = torch.randn(1, 3, size, size)
    with torch.no_grad():
        target = torch.randn_like(backbone(x))
    program = torch.export.export(model, (x, target), strict=True)
    return Graph(model, (x, target), _export_forward_backward(program))


class WeightedLoss(nn.Module):
    """``weight`` times a model's loss (an auxiliary-loss weight, or a mean over many terms)."""

    def __init__(self, model: nn.Module, weight: float) -> None:
        super().__init__()
        self.model = model
        self.weight = weight

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.model(x, target) * self.weight


def small_loss_graph(weight: float = 1e-5, size: int = 15, seed: int = 0) -> Graph:
    """``models.linear_backbone`` behind a trained adapter, its MSE loss times ``weight``.

    The gradients scale with ``weight``: at 1e-5 most are below 6e-8, fp16's
    smallest subnormal number, and at 1e-3 below its smallest normal (6.1e-5).
    """
    from torch.export.experimental import _export_forward_backward

    from .models import AdapterNet, linear_backbone

    torch.manual_seed(seed)
    net = AdapterNet(8, linear_backbone(8), trainable_backbone=True)
    x = torch.randn(1, 8, size, size)
    with torch.no_grad():
        target = torch.randn_like(net.backbone(net.adapter(x)))
    model = WeightedLoss(net, weight)
    program = torch.export.export(model, (x, target), strict=True)
    return Graph(model, (x, target), _export_forward_backward(program))
