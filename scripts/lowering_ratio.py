#!/usr/bin/env python3
"""A training graph's lowering time against its inference graph's, and a second lowering.

For each ``ARCH:SCHEME`` (``qnn_convbwd.finetune`` names: a torchvision classifier in
``eval()``, random weights; schemes ``full``, ``last-layers``, ``bias-only``,
``adapter``), in one process: ``qnn_convbwd.lower`` of the inference graph (batch
``--batch``) and of the joint training graph (cross-entropy, the same batch); then,
in a new process, the training graph lowered again through the cache (whole
lowerings and context binaries). The cache lives in a fresh directory per model, so
the first lowering compiles. Prints one Markdown row per model, with the time
QAIRT's finalisation took in the training graph's lowering (from
``qnn_convbwd.progress``; "forked" where several delegates were finalised in
forked processes, which report no phases). ``--max-delegate-ops N`` splits the
delegates (the option of that name) in every lowering. ``--steps N`` then runs N SGD
steps of the training program on the simulator and adds the median of those after
the first (which loads the delegates) as a last column.

    PYTHONPATH=. python scripts/lowering_ratio.py resnet18:last-layers \
        mobilenet_v2:full --soc SM8650 --weight-layout hwio
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

HEADER = (
    "| model | scheme | inference s | training s | of which QAIRT finalize s "
    "| training / inference | training without finalize / inference "
    "| second lowering, new process s | second / first | delegates | ops on CPU |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|"
)


def _finalize_seconds(events: list) -> float | None:
    """Seconds between each ``finalize`` event and the next event, summed; None when
    the delegates were finalised in forked processes (they report no phases)."""
    from qnn_convbwd import progress

    if any(event.phase == progress.PARALLEL for event in events):
        return None
    return sum(
        later.elapsed - event.elapsed
        for event, later in zip(events, events[1:])
        if event.phase == progress.FINALIZE
    )


def lower_once(arch: str, scheme: str, args: argparse.Namespace) -> dict:
    """Lower (inference unless ``--only-training``, then training) in this process."""
    import qnn_convbwd
    from qnn_convbwd import finetune, progress, training
    from qnn_convbwd.toolchain import harness
    from qnn_convbwd_dev import lowering_time

    specs = qnn_convbwd.compile_specs(args.soc)
    net = finetune.architecture(arch, seed=0).eval()
    x = torch.randn(args.batch, 3, args.size, args.size, generator=torch.Generator().manual_seed(0))
    y = torch.arange(args.batch) % 10
    found: dict = {"arch": arch, "scheme": scheme}
    options = {
        "weight_layout": args.weight_layout,
        "context_cache_dir": args.cache_dir,
        "max_delegate_ops": args.max_delegate_ops,
    }
    with qnn_convbwd.enabled(**options):
        if not args.only_training:
            program = torch.export.export(copy.deepcopy(net), (x,), strict=True)
            start = time.perf_counter()
            qnn_convbwd.lower(program, specs)
            found["inference_s"] = time.perf_counter() - start
        trained = finetune.apply_scheme(copy.deepcopy(net), scheme)
        joint = training.export_joint(training.WithLoss(trained, nn.CrossEntropyLoss()), (x, y))
        events: list = []
        start = time.perf_counter()
        with progress.observe(events.append):
            result = qnn_convbwd.lower(joint, specs)
        found["training_s"] = time.perf_counter() - start
        found["finalize_s"] = _finalize_seconds(events)
        if args.steps and not args.only_training:
            pte = result.edge.to_executorch().buffer
            found["step_s"] = lowering_time.simulator_step_seconds(pte, [x, y], args.steps)
    found["delegates"] = harness.delegate_count(result.edge)
    found["on_cpu"] = len(result.report.on_cpu)
    return found


def _child(model: str, args: argparse.Namespace, cache_dir: str, only_training: bool) -> dict:
    command = [
        sys.executable,
        __file__,
        model,
        "--child",
        "--soc",
        args.soc,
        "--batch",
        str(args.batch),
        "--size",
        str(args.size),
        "--weight-layout",
        args.weight_layout,
        "--cache-dir",
        cache_dir,
    ]
    if args.max_delegate_ops is not None:
        command += ["--max-delegate-ops", str(args.max_delegate_ops)]
    if only_training:
        command.append("--only-training")
    elif args.steps:
        command += ["--steps", str(args.steps)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _steps_cell(seconds: list[float] | None) -> str:
    """The steps after the first (which loads the delegates), as a median."""
    if not seconds:
        return ""
    later = sorted(seconds[1:] or seconds)
    return f" {later[len(later) // 2]:.2f} |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="ARCH:SCHEME, e.g. resnet18:last-layers")
    parser.add_argument("--soc", default="SM8650")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--weight-layout", default="hwio", choices=("torch", "hwio"))
    parser.add_argument(
        "--max-delegate-ops", type=int, help="split delegates (the option of that name)"
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=0,
        help="then time this many SGD steps of the training program on the simulator",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    parser.add_argument("--only-training", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        arch, scheme = args.models[0].split(":")
        print(json.dumps(lower_once(arch, scheme, args)), flush=True)
        return 0
    header = HEADER
    if args.steps:
        top, rule = HEADER.split("\n")
        header = f"{top} simulator step s |\n{rule}---|"
    print(header)
    for model in args.models:
        arch, scheme = model.split(":")
        with tempfile.TemporaryDirectory() as cache_dir:
            first = _child(model, args, cache_dir, only_training=False)
            second = _child(model, args, str(Path(cache_dir)), only_training=True)
        inference, training_s, again = (
            first["inference_s"],
            first["training_s"],
            second["training_s"],
        )
        finalize = first["finalize_s"]
        apart = "forked" if finalize is None else f"{finalize:.1f}"
        outside = "-" if finalize is None else f"{(training_s - finalize) / inference:.1f}x"
        print(
            f"| {arch} | {scheme} | {inference:.1f} | {training_s:.1f} | {apart} | "
            f"{training_s / inference:.1f}x | {outside} | "
            f"{again:.1f} | {again / training_s:.2f} | {first['delegates']} | "
            f"{first['on_cpu']} |" + _steps_cell(first.get("step_s")),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
