"""``qnn-convbwd finetune``: fine-tune a classifier on scikit-learn's digits, on the HTP
simulator next to torch.

Builds the model (``finetune.architecture``), applies the scheme, lowers its
joint training graph for the SoC and trains it in ``train()`` through
ExecuTorch's runtime, with torch eager + ``torch.optim.SGD`` on the same
batches (``finetune.fit``). Prints loss and test accuracy of both at each
evaluation point, then a summary, and writes a PNG of the curves.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .. import finetune

DEFAULT_LR, DEFAULT_MOMENTUM = 0.02, 0.9


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--arch",
        default="cifar",
        help="'cifar' (ExecuTorch's CIFAR-10 example, default) or a torchvision classifier "
        "(resnet18, mobilenet_v2, mobilenet_v3_small, efficientnet_b0, shufflenet_v2_x0_5, ...)",
    )
    parser.add_argument("--scheme", choices=finetune.SCHEMES, default="full")
    parser.add_argument("--batch", type=int, default=16, help="batch size (default 16)")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, help="SGD steps (default: one epoch)")
    length.add_argument("--epochs", type=int, help="epochs over the 1,500 training digits")
    parser.add_argument(
        "--eval-every", type=int, help="steps between test evaluations (default: an epoch)"
    )
    parser.add_argument("--lr", type=float, default=DEFAULT_LR, help=f"default {DEFAULT_LR}")
    parser.add_argument(
        "--momentum", type=float, default=DEFAULT_MOMENTUM, help=f"default {DEFAULT_MOMENTUM}"
    )
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--soc", default="SM8650", help="target SoC (default SM8650, HTP V75)")
    parser.add_argument("--size", type=int, default=32, help="image size (default 32)")
    parser.add_argument("--seed", type=int, default=0, help="weights, split and batch order")
    parser.add_argument(
        "--png", type=Path, default=Path("out/finetune.png"), help="curves (default %(default)s)"
    )
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="the CPU-only program: the same joint graph with no QNN delegate",
    )
    parser.add_argument(
        "--torch-masks",
        choices=finetune.TORCH_MASKS,
        default="program",
        help="torch's dropout masks: the program's (the same elements dropped, default) or its own",
    )
    parser.add_argument(
        "--eval-mode",
        action="store_true",
        help="train in eval(): running statistics, no dropout",
    )


class Progress:
    """``fit``'s progress: a tqdm bar on a terminal (else none), and one line per evaluation
    with the mean training loss since the previous one and the test accuracy, program
    next to torch."""

    def __init__(self, bar: bool) -> None:
        self.show_bar = bar
        self.bar = None
        self.since = 0  # steps done at the previous evaluation

    def header(self) -> str:
        return (
            f"{'step':>6}  {'epoch':>6}  {'loss program':>12}  {'loss torch':>12}  "
            f"{'acc program':>11}  {'acc torch':>11}"
        )

    def __call__(
        self, result: finetune.FitResult, total: int, evaluation: finetune.Evaluation | None
    ) -> None:
        if self.show_bar and self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="training", unit="step", file=sys.stdout)
        if self.bar is not None and result.steps:
            self.bar.update(len(result.steps) - self.bar.n)
        if evaluation is None:
            return
        recent = result.steps[self.since : evaluation.step]
        self.since = evaluation.step
        if recent:
            program = sum(s.program_loss for s in recent) / len(recent)
            reference = sum(s.torch_loss for s in recent) / len(recent)
            losses = f"{program:>12.4f}  {reference:>12.4f}"
        else:
            losses = f"{'-':>12}  {'-':>12}"
        program_accuracy = f"{100 * evaluation.program_accuracy:.1f}%"
        torch_accuracy = f"{100 * evaluation.torch_accuracy:.1f}%"
        line = (
            f"{evaluation.step:>6}  {evaluation.epoch:>6.2f}  {losses}  "
            f"{program_accuracy:>11}  {torch_accuracy:>11}"
        )
        if self.bar is not None:
            self.bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def summary(result: finetune.FitResult, png: Path | None) -> list[str]:
    """The lines printed after training."""
    where = "CPU-only program (SM8350: no delegate)" if result.cpu_only else result.soc
    lines = [
        f"lowering: {result.lowering_seconds:.1f} s for {where}; {result.delegates} delegate(s)",
    ]
    rules = result.on_cpu_by_rule()
    if rules:
        kept = ", ".join(f"{rule} {count}" for rule, count in rules.items())
        lines.append(f"ops on CPU by rule: {kept}")
    else:
        lines.append("ops on CPU: none")
    lines.append(
        f"step time: {1000 * result.mean_step_seconds:.1f} ms (program), "
        f"{1000 * result.mean_torch_step_seconds:.1f} ms (torch eager), mean after the first"
    )
    final = result.evaluations[-1]
    gap = 100 * (final.program_accuracy - final.torch_accuracy)
    lines.append(
        f"test accuracy after {final.step} steps: {100 * final.program_accuracy:.1f}% (program), "
        f"{100 * final.torch_accuracy:.1f}% (torch), {gap:+.1f} points"
    )
    if result.dropped_per_epoch:
        lines.append(
            f"{result.dropped_per_epoch} training samples past the last full batch of "
            f"{result.batch} are left out of each epoch"
        )
    lines.append(f"curves: {png}" if png else "curves: not drawn")
    return lines


def run(args: argparse.Namespace) -> int:
    from ..toolchain import SdkUnavailable, ensure_sdk

    try:
        data = finetune.digits(args.size, args.seed)
        # The CPU-only program is lowered through the QNN partitioner too (for SM8350).
        ensure_sdk()
    except (finetune.MissingDependency, SdkUnavailable) as err:
        print(f"qnn-convbwd finetune: {err}", file=sys.stderr)
        return 2
    model = finetune.architecture(args.arch, seed=args.seed)
    mode = "eval()" if args.eval_mode else "train()"
    where = "CPU-only program" if args.cpu else f"{args.soc} on the HTP simulator"
    print(
        f"qnn-convbwd finetune: {args.arch}, scheme {args.scheme}, in {mode}, {where}; digits "
        f"{len(data.train[1])} train / {len(data.test[1])} test at {args.size}x{args.size}, "
        f"batch {args.batch}, lr {args.lr:g}, momentum {args.momentum:g}"
        + ("" if args.eval_mode else f"; torch's dropout masks: {args.torch_masks}")
    )
    progress = Progress(bar=sys.stdout.isatty() and not args.no_progress)
    print(progress.header())
    try:
        result = finetune.fit(
            model,
            data.train,
            data.test,
            scheme=args.scheme,
            soc=args.soc,
            batch=args.batch,
            steps=args.steps,
            epochs=args.epochs,
            lr=args.lr,
            momentum=args.momentum,
            weight_decay=args.weight_decay,
            seed=args.seed,
            cpu_only=args.cpu,
            train_mode=not args.eval_mode,
            torch_masks=args.torch_masks,
            eval_every=args.eval_every,
            on_progress=progress,
        )
    finally:
        progress.close()
    result.name = args.arch
    try:
        png = result.plot(args.png)
    except finetune.MissingDependency as err:
        print(f"curves not drawn: {err}")
        png = None
    for line in summary(result, png):
        print(line)
    return 0
