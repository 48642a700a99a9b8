"""Fidelity of the training step of a torchvision model's tail, fed its fp32 activation.

The blocks ``forward_bisect.blocks`` lists from index START on (to the head),
trained by SCHEME (``zoo.trainable`` names, e.g. every bias), MSE against the
zoo graph's target, fed the fp32 activation the whole net computes at START for
the zoo graph's input. Lowered with ``qnn_convbwd.lower``, run on the simulator,
judged per tensor with ``qnn_convbwd_dev.fidelity``: whether a gradient's error
is made in the tail or comes with the forward error of the blocks before it.

    PYTHONPATH=. python scripts/tail_fidelity.py shufflenet_v2_x0_5 14 [--scheme bias_only]
        [--soc SM8650] [--size 32] [--neighbours K] [--set OPTION=VALUE ...]

``--neighbours K`` judges over the activation and K - 1 copies moved by one fp16
rounding (``fidelity.neighbours``; rms table, median verdict, the input's own).
"""

from __future__ import annotations

import argparse
import sys

import torch
from forward_bisect import blocks
from torch.export.experimental import _export_forward_backward

import qnn_convbwd
from qnn_convbwd.toolchain import harness
from qnn_convbwd_dev import fidelity, models, zoo
from qnn_convbwd_dev.zoo import parse_options


def tail_graph(arch: str, start: int, scheme: str, size: int = 32) -> models.TrainingGraph:
    """The training graph of ``blocks(net)[start:]`` fed the fp32 activation at ``start``."""
    net = zoo.calibrated(arch, size)
    train = set(zoo.trainable(net, scheme))
    for name, parameter in net.named_parameters():
        parameter.requires_grad_(name in train)
    x, target = torch.randn(1, 3, size, size), torch.randn(1, 10)  # zoo.graph's draws
    units = blocks(net)
    with torch.no_grad():
        for _, module in units[:start]:
            x = module(x)
    model = zoo.Finetune(torch.nn.Sequential(*[m for _, m in units[start:]]))
    inputs = (x, target)
    joint = _export_forward_backward(torch.export.export(model, inputs, strict=True))
    names = ", ".join(name for name, _ in units[start:])
    return models.TrainingGraph(f"{arch}[{start}:] ({names})", model, inputs, joint)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("arch")
    parser.add_argument("start", type=int, help="index into forward_bisect.blocks")
    parser.add_argument("--scheme", default="bias_only", choices=zoo.SCHEMES[:3])
    parser.add_argument("--soc", default="SM8650")
    parser.add_argument("--size", type=int, default=32, help="the zoo graph's input size, px")
    parser.add_argument("--neighbours", type=int, default=1, metavar="K")
    parser.add_argument(
        "--set", nargs="*", default=[], metavar="OPTION=VALUE", help="qnn_convbwd options"
    )
    args = parser.parse_args()
    graph = tail_graph(args.arch, args.start, args.scheme, args.size)
    with qnn_convbwd.enabled(**parse_options(args.set)):
        compiled = harness.lower_program(graph.program, args.soc)
        reports = zoo.reports(graph, compiled, args.neighbours, around=True)
    report = fidelity.pooled(reports)
    print(
        f"{graph.name}: {harness.delegate_count(compiled.edge)} delegate(s), input "
        f"{tuple(graph.inputs[0].shape)}"
    )
    print(report.to_markdown())
    if len(reports) == 1:
        return 0 if report.within else 1
    within, lines = fidelity.neighbourhood_summary(reports)
    print(f"pooled (rms) over the input and {len(reports) - 1} neighbours, above")
    print("\n".join(lines))
    return 0 if within else 1


if __name__ == "__main__":
    sys.exit(main())
