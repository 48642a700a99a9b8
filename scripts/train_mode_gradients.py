#!/usr/bin/env python3
"""A train-mode step's gradients against fp64: the program's, torch fp16's and fp32's.

Lowers the joint graph of ``--arch`` in ``train()`` (batch statistics) with
``--scheme``'s parameters trained and cross-entropy, runs one step through a
``TrainingSession`` on the HTP simulator (SGD, lr 1: the update is the gradient),
and computes the same gradients in torch eager fp64, fp32 and fp16 from the same
weights (dropout modules in ``eval()``: masks would differ). Prints, per trained
tensor, the relative L2 error against fp64 of the program's gradient, torch
fp16's and torch fp32's, and the ratio program / fp16.

Where fp32's own error is large, the step is ill-conditioned: rounding alone moves
its gradients, and a comparison of trajectories measures that. A gradient whose
fp64 norm is below ``--zero`` times the largest is zero in exact arithmetic (a
batch norm's bias whose output only reaches the loss through another batch norm in
train mode, which subtracts the batch mean again): every precision computes
rounding residue there, and the rows are listed apart.

    PYTHONPATH=. python scripts/train_mode_gradients.py --arch mobilenet_v2 \
        --scheme bias-only --soc SM8650
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch
from torch import nn

import qnn_convbwd
from qnn_convbwd import finetune, training
from qnn_convbwd.toolchain import harness
from qnn_convbwd_dev import zoo


def _torch_gradients(net: nn.Module, x, y, dtype) -> tuple[float, dict[str, torch.Tensor]]:
    model = copy.deepcopy(net).to(dtype)
    loss = nn.functional.cross_entropy(model(x.to(dtype)).to(torch.float64), y)
    loss.backward()
    return float(loss.detach()), {
        name: p.grad.to(torch.float64) for name, p in model.named_parameters() if p.requires_grad
    }


def _relative(ours: torch.Tensor, truth: torch.Tensor) -> float:
    return float((ours.to(torch.float64) - truth).norm() / truth.norm().clamp_min(1e-300))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="mobilenet_v2")
    parser.add_argument("--scheme", default="bias-only", choices=finetune.SCHEMES)
    parser.add_argument("--soc", default="SM8650")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--zero", type=float, default=1e-6, help="relative norm of a zero gradient")
    args = parser.parse_args()

    # Dropout in eval(): the same step everywhere, no masks.
    net, x, y = zoo.train_mode_batch(args.arch, args.scheme, args.batch, args.size, args.seed)
    qnn_convbwd.enable()
    program = training.lower_for_training(
        training.WithLoss(copy.deepcopy(net), nn.functional.cross_entropy),
        (x, y),
        harness.compile_specs(args.soc),
    )
    session = program.session(1.0)
    before = {name: t.clone() for name, t in session.state_dict().items()}
    loss = session.step([x, y])
    after = session.state_dict()
    session.close()

    losses, gradients = {}, {}
    for dtype in (torch.float64, torch.float32, torch.float16):
        losses[dtype], gradients[dtype] = _torch_gradients(net, x, y, dtype)
    truth = gradients[torch.float64]
    largest = max(float(g.norm()) for g in truth.values())
    print(
        f"{args.arch} {args.scheme} train() batch {args.batch} {args.size}px {args.soc} "
        f"seed {args.seed}: loss program {loss:.5f}, fp64 {losses[torch.float64]:.5f}, "
        f"fp32 {losses[torch.float32]:.5f}, fp16 {losses[torch.float16]:.5f}"
    )
    print("| tensor | fp64 norm | program rel L2 | torch fp16 | torch fp32 | program / fp16 |")
    print("|---|---|---|---|---|---|")
    kept, zero = [], []
    for name, exact in truth.items():
        ours = _relative(before[name] - after[name], exact)
        half = _relative(gradients[torch.float16][name], exact)
        single = _relative(gradients[torch.float32][name], exact)
        row = (name, float(exact.norm()), ours, half, single, ours / max(half, 1e-300))
        (zero if row[1] < args.zero * largest else kept).append(row)
    for name, norm, ours, half, single, ratio in kept + zero:
        print(f"| {name} | {norm:.2e} | {ours:.3g} | {half:.3g} | {single:.3g} | {ratio:.2f} |")
    if kept:
        ratios = [row[5] for row in kept]
        print(
            f"{len(kept)} tensors: program / fp16 median {statistics.median(ratios):.2f}, "
            f"range {min(ratios):.2f} - {max(ratios):.2f}; torch fp32's own error median "
            f"{statistics.median(row[4] for row in kept):.3g}"
        )
    if zero:
        print(
            f"{len(zero)} tensors zero in exact arithmetic (fp64 norm below {args.zero:g} of "
            f"the largest): program / fp16 on their residue "
            f"{min(row[5] for row in zero):.2f} - {max(row[5] for row in zero):.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
