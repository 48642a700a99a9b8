#!/usr/bin/env python3
"""A program of several delegates lowered with its delegates finalised in process and
in forked processes, side by side.

For each ``ARCH:SCHEME`` (``qnn_convbwd.finetune`` names, in ``eval()``, random
weights), the joint training graph (cross-entropy, batch ``--batch``) is split into
delegates of at most ``--max-delegate-ops`` ops and lowered ``--repeat`` times with
``finalize_workers=1`` and with ``--workers``, alternating, caches off. Prints the
lowering times, the speed-up, and the loss of one simulator step of each program
(the same program: equal losses). From the in-process lowering's progress events
(each delegate's build and finalisation), it also estimates the time with the
delegates spread over ``--workers`` and over 16 cores: the rest of the lowering as
it was, the delegates in the longer of the slowest one and an even share of their
sum (memory bandwidth and QAIRT's own threads not modelled).

    PYTHONPATH=. python scripts/parallel_finalize.py resnet18:last-layers \
        --max-delegate-ops 80 --soc SM8650
"""

from __future__ import annotations

import argparse
import copy
import os
import time

import torch
from torch import nn

import qnn_convbwd
from qnn_convbwd import finetune, parallel_finalize, progress, training
from qnn_convbwd.toolchain import harness


def lower(joint, specs, workers: int, max_ops: int) -> tuple[float, object, list[float]]:
    """Seconds, the lowering, and (in process) each delegate's build and finalisation."""
    events: list[progress.Event] = []
    with (
        qnn_convbwd.enabled(
            max_delegate_ops=max_ops,
            finalize_workers=workers,
            context_cache=False,
            lowering_cache=False,
        ),
        progress.observe(events.append),
    ):
        start = time.perf_counter()
        result = qnn_convbwd.lower(joint, specs)
        seconds = time.perf_counter() - start
    starts = [e.elapsed for e in events if e.phase == progress.BUILD]
    ends = starts[1:] + [next((e.elapsed for e in events if e.phase == progress.DONE), seconds)]
    return seconds, result, [end - begin for begin, end in zip(starts, ends)]


def estimate(total: float, per_delegate: list[float], workers: int) -> float:
    """The in-process lowering's time with its delegates spread over ``workers``: the
    rest as it was, the delegates in the longest of one delegate or an even share."""
    spent = sum(per_delegate)
    return total - spent + max(max(per_delegate), spent / workers)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="ARCH:SCHEME, e.g. resnet18:last-layers")
    parser.add_argument("--max-delegate-ops", type=int, required=True)
    parser.add_argument("--workers", type=int, default=parallel_finalize.available_cores())
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--soc", default="SM8650")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--size", type=int, default=32)
    args = parser.parse_args()
    specs = qnn_convbwd.compile_specs(args.soc)
    print(
        f"{args.soc}, batch {args.batch}, {args.size}px, max_delegate_ops "
        f"{args.max_delegate_ops}, {args.workers} workers, load {os.getloadavg()[0]:.1f}"
    )
    print(
        "| model | scheme | delegates | in process s | forked s | speed-up "
        f"| estimated, {args.workers} workers s | estimated, 16 workers s | losses equal |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for model in args.models:
        arch, scheme = model.split(":")
        net = finetune.apply_scheme(finetune.architecture(arch, seed=0).eval(), scheme)
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(args.batch, 3, args.size, args.size, generator=generator)
        y = torch.arange(args.batch) % 10
        joint = training.export_joint(
            training.WithLoss(copy.deepcopy(net), nn.CrossEntropyLoss()), (x, y)
        )
        times: dict[int, list[float]] = {1: [], args.workers: []}
        programs, estimates = {}, {1: [], 16: []}
        for _ in range(args.repeat):
            for workers in (1, args.workers):
                seconds, programs[workers], per_delegate = lower(
                    joint, specs, workers, args.max_delegate_ops
                )
                times[workers].append(seconds)
                if workers == 1:
                    estimates[1].append(estimate(seconds, per_delegate, args.workers))
                    estimates[16].append(estimate(seconds, per_delegate, 16))
                    print(
                        f"  in process: {seconds:.1f} s, per delegate "
                        + ", ".join(f"{t:.1f}" for t in per_delegate),
                        flush=True,
                    )
        losses = []
        for workers in (1, args.workers):
            pte = programs[workers].edge.to_executorch().buffer
            run = training.train_side_by_side(
                pte, training.WithLoss(net, nn.CrossEntropyLoss()), (x, y), 1, 0.01
            )
            losses.append(run.steps[0].loss)
        alone = sum(times[1]) / len(times[1])
        forked = sum(times[args.workers]) / len(times[args.workers])
        delegates = harness.delegate_count(programs[1].edge)
        print(
            f"| {arch} | {scheme} | {delegates} | {alone:.1f} | {forked:.1f} "
            f"| {alone / forked:.2f}x | {sum(estimates[1]) / len(estimates[1]):.1f} "
            f"| {sum(estimates[16]) / len(estimates[16]):.1f} "
            f"| {losses[0] == losses[1]} ({losses[0]:.5f}) |",
            flush=True,
        )
    print(f"load {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
