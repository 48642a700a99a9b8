"""Forward precision of a torchvision model's blocks on the HTP simulator, block by block.

Each block of ``net.features`` (EfficientNet's stages expanded into their MBConv
blocks; ShuffleNetV2's ``conv1``, ``maxpool`` and the blocks of its stages;
ResNet's stem, ``maxpool`` and its residual blocks) and the head, fed the fp32
input it gets in the whole net (``qnn_convbwd_dev.zoo.calibrated``: random weights,
batch-norm statistics from random batches), is exported alone as an inference
program, lowered with ``qnn_convbwd.lower`` and run. One markdown row per
block: relative L2 of the HTP's output and of torch fp16's (the block in
float16 on CPU) against fp32, their ratio, and the HTP error's systematic parts:
the least-squares gain ``<htp, ref> / <ref, ref> - 1`` and the mean error over
the rms error.

    PYTHONPATH=. python scripts/forward_bisect.py efficientnet_b0 [--size 32] [--soc SM8650]
        [--blocks 3 4] [--prefix] [--set OPTION=VALUE ...]

``--prefix`` runs ``features[:k]`` from the net's input instead (the error as it
accumulates). ``--train-mode`` runs every block in ``train()`` (batch norms
normalise with the batch's statistics, as in a training step; dropout stays
off) on a batch of ``--batch``; the program then also updates the running
statistics, which this does not judge.
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch

import qnn_convbwd
from qnn_convbwd.toolchain import harness
from qnn_convbwd_dev import fidelity, reference_kernels, zoo
from qnn_convbwd_dev.zoo import parse_options


class Head(torch.nn.Module):
    """The classifier after the feature extractor, as the net's own ``forward`` runs it.

    EfficientNet / MobileNetV3: pool, flatten, classifier; ResNet: pool, flatten,
    ``fc``; MobileNetV2 (no pool module): a global mean, then the classifier;
    SqueezeNet: classifier (its pool is in it), flatten; ShuffleNetV2:
    ``conv5``, spatial mean, ``fc``.
    """

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.avgpool = getattr(net, "avgpool", None)
        self.conv5 = getattr(net, "conv5", None)
        self.classifier = net.fc if hasattr(net, "fc") else net.classifier
        self.convolutional = any(isinstance(m, torch.nn.Conv2d) for m in self.classifier.modules())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.conv5 is not None:  # ShuffleNetV2
            return self.classifier(self.conv5(x).mean([2, 3]))
        if self.convolutional:  # SqueezeNet
            return torch.flatten(self.classifier(x), 1)
        if self.avgpool is None:  # MobileNetV2
            x = torch.nn.functional.adaptive_avg_pool2d(x, (1, 1))
        else:
            x = self.avgpool(x)
        return self.classifier(torch.flatten(x, 1))


def _trunk(net: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, stage) of the feature extractor: ``features``' children, or a net's parts.

    ResNet: ``stem`` (``conv1``, ``bn1``, ``relu`` as one unit), ``maxpool``, ``layer1``-``layer4``;
    ShuffleNetV2: ``conv1``, ``maxpool``, ``stage2``-``stage4``.
    """
    if hasattr(net, "features"):
        return [(f"features.{n}", c) for n, c in net.features.named_children()]
    if hasattr(net, "layer4"):  # ResNet
        stem = torch.nn.Sequential(net.conv1, net.bn1, net.relu)
        layers = [(f"layer{k}", getattr(net, f"layer{k}")) for k in range(1, 5)]
        return [("stem", stem), ("maxpool", net.maxpool), *layers]
    return [(n, getattr(net, n)) for n in ("conv1", "maxpool", "stage2", "stage3", "stage4")]


def blocks(net: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) in execution order: each block of the feature extractor and the head.

    A stage that is a ``Sequential`` of blocks (EfficientNet's MBConv stages,
    ShuffleNet's ``stageN``) is expanded into its blocks.
    """
    out = []
    for name, child in _trunk(net):
        if isinstance(child, torch.nn.Sequential) and not isinstance(
            child[0], (torch.nn.Conv2d, torch.nn.BatchNorm2d)
        ):
            out += [(f"{name}.{n}", c) for n, c in child.named_children()]
        else:
            out.append((name, child))
    out.append(("head", Head(net)))
    return out


def systematic(actual: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(gain - 1, mean error / rms error) of ``actual`` against ``reference``."""
    a, r = actual.double().flatten(), reference.double().flatten()
    err = a - r
    gain = (a @ r / (r @ r)).item() - 1.0
    rms = err.pow(2).mean().sqrt().item()
    return gain, (err.mean().item() / rms) if rms else 0.0


def _mode(module: torch.nn.Module, train: bool) -> torch.nn.Module:
    """A copy of ``module`` in ``train()`` with its dropout off, or in ``eval()``.

    In ``train()``, a batch norm with ``momentum=None`` (``zoo.calibrated`` leaves
    the cumulative average) takes torch's default 0.1: the output is the same."""
    module = copy.deepcopy(module).train(train)
    for inner in module.modules():
        if isinstance(inner, torch.nn.modules.dropout._DropoutNd):
            inner.eval()
        if train and isinstance(inner, torch.nn.modules.batchnorm._BatchNorm):
            inner.momentum = 0.1 if inner.momentum is None else inner.momentum
    return module


def measure(
    module: torch.nn.Module, x: torch.Tensor, soc: str, train: bool = False
) -> dict[str, float]:
    with torch.no_grad(), reference_kernels.pinned():  # a lowering above turned oneDNN off
        ref = _mode(module, train)(x)
    with torch.no_grad(), reference_kernels.fp16_kernels():
        half = _mode(module, train).half()(x.half()).float()
    program = torch.export.export(_mode(module, train), (x,), strict=True)
    compiled = harness.lower_program(program, soc)
    out = compiled.run([x])[0]
    htp, floor = fidelity.Metrics.of(out, ref), fidelity.Metrics.of(half, ref)
    gain, bias = systematic(out, ref)
    fgain, fbias = systematic(half, ref)
    return {
        "delegates": harness.delegate_count(compiled.edge),
        "htp": htp.rel_l2,
        "fp16": floor.rel_l2,
        "gain": gain,
        "bias": bias,
        "fp16_gain": fgain,
        "fp16_bias": fbias,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("arch")
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--soc", default="SM8650")
    parser.add_argument("--blocks", nargs="*", type=int, help="indices into the block list")
    parser.add_argument("--prefix", action="store_true", help="features[:k] from the input")
    parser.add_argument("--train-mode", action="store_true", help="blocks in train()")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument(
        "--set", nargs="*", default=[], metavar="OPTION=VALUE", help="qnn_convbwd options"
    )
    args = parser.parse_args()
    with qnn_convbwd.enabled(**parse_options(args.set)):
        return bisect(args)


def bisect(args: argparse.Namespace) -> int:
    net = zoo.calibrated(args.arch, args.size)
    torch.manual_seed(0)
    x = torch.randn(args.batch, 3, args.size, args.size)
    units = blocks(net)
    inputs = []
    with torch.no_grad(), reference_kernels.pinned():
        h = x
        for _, module in units:
            inputs.append(h)
            h = _mode(module, args.train_mode)(h)
        if not torch.allclose(h, _mode(net, args.train_mode)(x), rtol=1e-5, atol=1e-6):
            raise RuntimeError(f"{args.arch}: the blocks composed are not the net")
    chosen = args.blocks if args.blocks else range(len(units))
    print(
        "| # | block | input | delegates | HTP rel L2 | fp16 rel L2 | ratio "
        "| HTP gain-1 | HTP mean/rms | fp16 gain-1 | fp16 mean/rms |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|"
    )
    for i in chosen:
        name, module = units[i]
        if args.prefix:
            module = torch.nn.Sequential(*[m for _, m in units[: i + 1]])
            name, inp = f"[:{i + 1}] ... {name}", x
        else:
            inp = inputs[i]
        m = measure(module, inp, args.soc, args.train_mode)
        print(
            f"| {i} | {name} | {tuple(inp.shape[1:])} | {m['delegates']} | {m['htp']:.3g} "
            f"| {m['fp16']:.3g} | {m['htp'] / m['fp16']:.2f} | {m['gain']:.2e} "
            f"| {m['bias']:.2f} | {m['fp16_gain']:.2e} | {m['fp16_bias']:.2f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
