#!/usr/bin/env python3
"""Where ``qnn_convbwd.lower()`` spends its time, per phase (``qnn_convbwd_dev.lowering_time``).

``model`` mode: for a torchvision model, a training scheme and a SoC
(``qnn_convbwd_dev.zoo.graph``), lowers in one process the inference graph (the
calibrated net in eval mode, batch 1) and the joint training graph, and prints
per lowering the time of each phase (export passes, partition, QNN graph build
and QNN finalisation per delegate, the rest of ``lower()``), the ATen ops of
the program and the QNN ops of the delegates by type.

``micro`` mode: one convolution with a trainable weight, ``CxCxK`` at a square
input size, lowered as the forward alone with the weight frozen, the forward
alone with the weight a run-time input, and the training step (the input is
not trained: forward and grad_weight) once per ``--weight-layouts`` entry
(``Options.weight_layout``: the weight entering the delegate and its gradient
leaving it as OIHW or as HWIO); plus the weight permutation alone (a graph
input permuted from OIHW to HWIO, and the same as the collapsed Transpose
``qnn_ops.weight_transpose`` emits) and, as the control, the weight only
scaled, taken as an OIHW input, as an HWIO one and as ``[O, I*k*k]`` and
``[k*k*I, O]`` ones, to isolate what QNN's finalisation costs for each.

``--weight-layout`` sets ``Options.weight_layout`` for the ``model`` mode;
``--steps N`` then times N training steps of the lowered program on the
simulator. The compiled-context cache is off: every row compiles.

    PYTHONPATH=. python scripts/lowering_time.py model resnet18 last_layers --soc SM8650
    PYTHONPATH=. python scripts/lowering_time.py micro 512x512x1 512x512x3 --sizes 4 8
    PYTHONPATH=. python scripts/lowering_time.py micro 512x512x3 --sizes 4 --steps-only \
        --weight-layouts torch hwio
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path

import torch

from qnn_convbwd import options
from qnn_convbwd.geometry import conv as geo
from qnn_convbwd.geometry import permutation
from qnn_convbwd.toolchain import harness
from qnn_convbwd_dev import lowering_time


def _counts(counter: Counter, top: int = 12) -> str:
    return ", ".join(f"{k} {v}" for k, v in counter.most_common(top))


def row(
    label: str,
    program: torch.export.ExportedProgram,
    soc: str,
    lowered: list | None = None,
    weight_layout: str = "torch",
) -> dict:
    """Lower ``program`` once, the context cache off; print and return its phase times
    and op counts (and append the ``LoweringResult`` to ``lowered`` when given)."""
    timing, lowering = lowering_time.measure(
        program, harness.compile_specs(soc), context_cache=False, weight_layout=weight_layout
    )
    if lowered is not None:
        lowered.append(lowering)
    aten = lowering_time.aten_ops(program)
    qnn = timing.qnn_ops()
    result = {
        "label": label,
        "total_s": timing.total_s,
        "export_passes_s": timing.export_passes_s,
        "partition_s": timing.partition_s,
        "build_s": timing.build_s,
        "finalise_s": timing.finalise_s,
        "rest_s": timing.rest_s,
        "delegates": [
            {"build_s": d.build_s, "finalise_s": d.finalise_s, "qnn_ops": d.op_count}
            for d in timing.delegates
        ],
        "aten_ops": sum(aten.values()),
        "qnn_ops": dict(qnn),
    }
    finalise = " + ".join(f"{d.finalise_s:.1f}" for d in timing.delegates)
    print(
        f"| {label} | {timing.total_s:.1f} | {timing.export_passes_s:.1f} "
        f"| {timing.partition_s:.1f} | {timing.build_s:.1f} | {finalise or '-'} "
        f"| {timing.rest_s:.1f} | {sum(aten.values())} | {sum(qnn.values())} |",
        flush=True,
    )
    print(f"    ATen: {_counts(aten)}", flush=True)
    print(f"    QNN:  {_counts(qnn)}", flush=True)
    return result


HEADER = (
    "| lowering | total s | export passes s | partition s | QNN build s "
    "| QNN finalise s (per delegate) | rest s | ATen ops | QNN ops |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


def step_times(lowered, graph, steps: int, weight_layout: str) -> list[float]:
    """Seconds of each of ``steps`` SGD steps of the lowered joint program on the
    simulator (the first includes loading its delegates)."""
    from qnn_convbwd import api

    # A program that mutates buffers is emitted inside enabled() (training metadata).
    with api.enabled(weight_layout=weight_layout):
        pte = lowered.edge.to_executorch().buffer
    return lowering_time.simulator_step_seconds(pte, graph.inputs, steps)


def model_rows(
    arch: str,
    scheme: str,
    soc: str,
    size: int,
    which: list[str],
    steps: int = 0,
    weight_layout: str = "torch",
) -> list[dict]:
    from qnn_convbwd_dev import zoo

    rows = []
    if "inference" in which:
        net = zoo.calibrated(arch, size)
        program = torch.export.export(net, (torch.randn(1, 3, size, size),), strict=True)
        rows.append(row(f"{arch} {size}px inference", program, soc))
    if "training" in which:
        graph = zoo.graph(arch, scheme, size)
        lowered: list = []
        label = f"{arch} {size}px {scheme}, weight {weight_layout}"
        rows.append(row(label, graph.program, soc, lowered, weight_layout))
        if steps:
            seconds = step_times(lowered[0], graph, steps, weight_layout)
            rows[-1]["step_s"] = seconds
            print("    simulator step s: " + ", ".join(f"{s:.1f}" for s in seconds), flush=True)
    return rows


class Conv(torch.nn.Module):
    def __init__(self, channels_in: int, channels_out: int, kernel: int) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(
            channels_in, channels_out, kernel, padding=kernel // 2, bias=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class ConvStep(torch.nn.Module):
    """The loss of one convolution; its joint graph has grad_input and grad_weight."""

    def __init__(self, conv: Conv) -> None:
        super().__init__()
        self.conv = conv

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.nn.functional.mse_loss(self.conv(x), target),)


class RuntimeWeightConv(torch.nn.Module):
    """The forward convolution with its weight a graph input (read at run time)."""

    def __init__(self, kernel: int) -> None:
        super().__init__()
        self.padding = kernel // 2

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.conv2d(x, weight, padding=self.padding)


class Permute(torch.nn.Module):
    """A run-time weight permuted OIHW -> HWIO, as one 4-D or one collapsed transpose."""

    def __init__(self, shape: torch.Size, collapsed: bool) -> None:
        super().__init__()
        # as ``qnn_ops.weight_transpose`` emits it
        self.view = permutation.collapse(shape, geo.OIHW_TO_HWIO) if collapsed else None

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        if self.view is not None:
            moved = weight.reshape(self.view.source_shape).permute(self.view.perm)
            return moved.reshape(self.view.result_shape) * 2.0
        return weight.permute(geo.OIHW_TO_HWIO) * 2.0


class Scale(torch.nn.Module):
    """No permutation at all: the control for ``Permute`` (an input of the same elements)."""

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * 2.0


def micro_rows(
    configs: list[str], sizes: list[int], soc: str, layouts: list[str], steps_only: bool
) -> list[dict]:
    from torch.export.experimental import _export_forward_backward

    rows = []
    for config in configs:
        cin, cout, k = (int(v) for v in config.split("x"))
        weight = torch.randn(cout, cin, k, k)
        hwio = weight.permute(geo.OIHW_TO_HWIO).contiguous()
        if not steps_only:
            for name, collapsed in (("4-D", False), ("collapsed", True)):
                program = torch.export.export(
                    Permute(weight.shape, collapsed), (weight,), strict=True
                )
                rows.append(row(f"{config} weight permutation, {name}", program, soc))
            for name, value in (
                ("OIHW", weight),
                ("HWIO", hwio),
                ("[O, I*k*k]", weight.reshape(cout, -1)),
                ("[k*k*I, O]", hwio.reshape(-1, cout)),
            ):
                program = torch.export.export(Scale(), (value,), strict=True)
                rows.append(row(f"{config} no permutation, {name} input", program, soc))
        for size in sizes:
            torch.manual_seed(0)
            conv = Conv(cin, cout, k)
            x = torch.randn(1, cin, size, size)
            if not steps_only:
                conv.requires_grad_(False)
                frozen = torch.export.export(conv, (x,), strict=True)
                rows.append(row(f"{config} @{size} forward, frozen weight", frozen, soc))
                runtime = torch.export.export(RuntimeWeightConv(k), (x, weight), strict=True)
                rows.append(row(f"{config} @{size} forward, run-time weight", runtime, soc))
            conv.requires_grad_(True)
            step = ConvStep(conv)
            target = torch.randn(1, cout, size, size)
            joint = _export_forward_backward(torch.export.export(step, (x, target), strict=True))
            for layout in layouts:
                label = f"{config} @{size} training step, weight {layout}"
                rows.append(row(label, joint, soc, weight_layout=layout))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    model = sub.add_parser("model", help="a torchvision model's inference and training graphs")
    model.add_argument("arch")
    model.add_argument(
        "scheme", help="bias_only, last_layers, full or adapter (qnn_convbwd_dev/zoo.py)"
    )
    model.add_argument("--size", type=int, default=32)
    model.add_argument(
        "--only", choices=("inference", "training"), help="lower only one of the two graphs"
    )
    micro = sub.add_parser("micro", help="single trainable convolutions")
    micro.add_argument("configs", nargs="+", help="CinxCoutxK, e.g. 512x512x1")
    micro.add_argument("--sizes", type=int, nargs="+", default=[4, 8])
    micro.add_argument(
        "--weight-layouts", nargs="+", choices=options.WEIGHT_LAYOUTS, default=["torch"]
    )
    micro.add_argument("--steps-only", action="store_true", help="only the training steps")
    model.add_argument("--weight-layout", choices=options.WEIGHT_LAYOUTS, default="torch")
    model.add_argument(
        "--steps", type=int, default=0, help="then time this many training steps on the simulator"
    )
    for p in (model, micro):
        p.add_argument("--soc", default="SM8650")
        p.add_argument("--json", type=Path, help="append the rows to this file, one per line")
    args = parser.parse_args(argv)

    load = os.getloadavg()
    print(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, soc {args.soc}")
    print(HEADER)
    if args.mode == "model":
        which = [args.only] if args.only else ["inference", "training"]
        rows = model_rows(
            args.arch, args.scheme, args.soc, args.size, which, args.steps, args.weight_layout
        )
    else:
        rows = micro_rows(args.configs, args.sizes, args.soc, args.weight_layouts, args.steps_only)
    load = os.getloadavg()
    print(f"load average at end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if args.json:
        with args.json.open("a") as out:
            for r in rows:
                out.write(json.dumps({**r, "soc": args.soc, "load": load[0]}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
