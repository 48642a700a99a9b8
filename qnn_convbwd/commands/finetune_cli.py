"""``qnn-convbwd finetune``: fine-tune a classifier on your images (or scikit-learn's digits)
through a lowered training program, next to torch.

Reads the data (``finetune_data``: an ImageFolder or a tensor file, held-out data
from ``--val`` or ``--val-split``), builds the model (``--arch``, or ``--model
module:function``; ``--weights`` loaded strictly), checks all of it before writing
anything, lowers the joint training graph for the SoC with the optimizer (``--optimizer
sgd|adamw``) inside it and trains it in ``train()`` through ExecuTorch's runtime, one
program call per step, with torch eager and the same ``torch.optim`` optimizer on the
same batches unless ``--no-torch`` (``finetune.fit``); ``--head-epochs`` trains the head alone
first, a warm start with its own program and optimizer (one epoch by default for adapters
inside a quantized backbone). With ``--out`` it saves a checkpoint every
``--checkpoint-every`` steps, and after the last step the trained ``state_dict``,
the training program starting from the trained weights, an inference program,
``report.json`` and the curves; ``--resume`` continues a killed run.

Bad input exits with status 2 and one message, before anything is written.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from .. import finetune, finetune_data, quantized

DEFAULT_LR, DEFAULT_MOMENTUM = 0.02, 0.9
DEFAULT_VAL_SPLIT = 0.1  # with --data and no --val


class UsageError(Exception):
    """Bad input: printed as one line, exit status 2."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    data = parser.add_argument_group("data")
    data.add_argument(
        "--data",
        type=Path,
        help="training data: a folder of class folders of images (torchvision's ImageFolder "
        "layout) or a .pt/.npz file with tensors x (N, C, H, W) and y (labels); default "
        "scikit-learn's digits",
    )
    held = data.add_mutually_exclusive_group()
    held.add_argument("--val", type=Path, help="held-out data, a folder or file as --data")
    held.add_argument(
        "--val-split",
        type=float,
        help=f"hold out this fraction of --data (default {DEFAULT_VAL_SPLIT} without --val)",
    )
    data.add_argument("--size", type=int, default=32, help="image size (default 32)")
    model = parser.add_argument_group("model")
    model.add_argument(
        "--arch",
        default="cifar",
        help="'cifar' (ExecuTorch's CIFAR-10 example, default) or a torchvision classifier "
        "(resnet18, mobilenet_v2, mobilenet_v3_small, efficientnet_b0, shufflenet_v2_x0_5, ...)",
    )
    model.add_argument(
        "--model",
        help="your own model instead of --arch: module:function, called as "
        "function(num_classes=N) and returning an nn.Module",
    )
    model.add_argument(
        "--weights",
        type=Path,
        help="start from this torch state_dict file (strict; a classifier of another class "
        "count is replaced)",
    )
    model.add_argument(
        "--scheme",
        choices=finetune.SCHEMES,
        help=f"what trains (default full; {finetune.QUANTIZED_SCHEME} with --quantize)",
    )
    model.add_argument(
        "--quantize",
        choices=sorted(quantized.SCHEMES),
        help="quantize the backbone (executorch's QnnQuantizer, per-channel int8 weights; "
        "8- or 16-bit activations) after calibration on the training data; the head "
        "stays float and trains (--scheme head), with float adapters inside the backbone "
        "(--scheme adapter)",
    )
    model.add_argument(
        "--calibration-batches",
        type=int,
        default=finetune.CALIBRATION_BATCHES,
        help="with --quantize: training batches of --batch images to calibrate on "
        f"(default {finetune.CALIBRATION_BATCHES})",
    )
    run = parser.add_argument_group("training")
    run.add_argument("--batch", type=int, default=16, help="batch size (default 16)")
    length = run.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, help="optimizer steps (default: one epoch)")
    length.add_argument("--epochs", type=int, help="epochs over the training data")
    run.add_argument("--eval-every", type=int, help="steps between evaluations (default: an epoch)")
    run.add_argument(
        "--lr",
        type=float,
        help=f"default {DEFAULT_LR}; {finetune.ADAPTER_LR} for --scheme adapter with --quantize "
        "after the head's warm start (--head-epochs), the rate at which adapters refine the "
        "features of a head that is mostly right",
    )
    run.add_argument(
        "--head-epochs",
        type=int,
        help="epochs of the head alone first (a warm start), then --steps / --epochs of "
        "--scheme with a fresh optimizer. Default 1 for --scheme adapter with --quantize "
        "(adapters trained from the first step take the gradients of a confidently wrong "
        "head and pull the backbone's features off), else 0",
    )
    run.add_argument(
        "--head-lr",
        type=float,
        help=f"the warm start's learning rate (default {finetune.HEAD_LR}, no schedule; "
        "--optimizer, --momentum and --weight-decay as for --scheme)",
    )
    run.add_argument(
        "--lr-schedule",
        choices=finetune.LR_SCHEDULES,
        default="none",
        help="cosine: down to 0 along half a cosine; step: x0.1 at 1/2 and 3/4 of the steps",
    )
    run.add_argument(
        "--optimizer",
        choices=finetune.OPTIMIZERS,
        default="sgd",
        help="applied inside the training program (one program call is one step); the torch "
        "copy uses the same torch.optim optimizer. Default sgd",
    )
    run.add_argument(
        "--momentum",
        type=float,
        help=f"SGD's momentum (default {DEFAULT_MOMENTUM}; not for adamw)",
    )
    run.add_argument(
        "--weight-decay",
        type=float,
        help="sgd: L2 decay added to the gradient (default 0); adamw: decoupled decay "
        "(default 0.01, torch's)",
    )
    run.add_argument("--soc", default="SM8650", help="target SoC (default SM8650, HTP V75)")
    run.add_argument("--seed", type=int, default=0, help="weights, split and batch order")
    run.add_argument(
        "--cpu",
        action="store_true",
        help="the CPU-only program: the same joint graph lowered for SM8350, no QNN delegate",
    )
    run.add_argument(
        "--no-torch", action="store_true", help="train the program alone (no torch copy)"
    )
    run.add_argument(
        "--torch-masks",
        choices=finetune.TORCH_MASKS,
        default="program",
        help="torch's dropout masks: the program's (the same elements dropped, default) or its own",
    )
    run.add_argument(
        "--eval-mode",
        action="store_true",
        help="train in eval(): running statistics, no dropout",
    )
    out = parser.add_argument_group("output")
    out.add_argument(
        "--out",
        type=Path,
        help="folder for model.pt, train.pte, infer.pte, report.json, curves.png and "
        "checkpoints (without it only the curves are drawn)",
    )
    out.add_argument("--overwrite", action="store_true", help="replace a run already in --out")
    out.add_argument(
        "--resume",
        type=Path,
        metavar="DIR",
        help="continue the run in DIR from its checkpoint, with its own options",
    )
    out.add_argument(
        "--checkpoint-every", type=int, help="steps between checkpoints (default: an epoch)"
    )
    out.add_argument(
        "--external-weights",
        action="store_true",
        help="train.pte keeps its weights in train.ptd beside it",
    )
    out.add_argument(
        "--png",
        type=Path,
        help="curves (default <out>/curves.png, or out/finetune.png without --out)",
    )


# --- the run's inputs, checked before anything is written ------------------------------


@dataclasses.dataclass
class Inputs:
    train: tuple[torch.Tensor, torch.Tensor]
    val: tuple[torch.Tensor, torch.Tensor]
    classes: list[str]
    normalize: finetune_data.Normalize
    model: torch.nn.Module
    notes: list[str]  # what the command tells the user about its inputs
    fingerprint: str  # of the normalised data: a resumed run must read the same


def _fingerprint(*tensors: torch.Tensor) -> str:
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()


def _read_data(args: argparse.Namespace) -> tuple[Any, Any, list[str], Any, str]:
    """(train, val, classes, normalize, description)."""
    if args.data is None:
        if args.val is not None or args.val_split is not None:
            raise UsageError("--val and --val-split need --data (the digits have their own split)")
        split = finetune.digits(args.size, args.seed)
        classes = [str(i) for i in range(10)]
        described = (
            f"digits {len(split.train[1])} train / {len(split.test[1])} held out "
            f"at {args.size}x{args.size}"
        )
        return split.train, split.test, classes, finetune_data.Normalize.identity(), described
    train = finetune_data.load(args.data, args.size)
    if args.val is not None:
        val = finetune_data.load(args.val, args.size, classes=train.classes)
    else:
        fraction = DEFAULT_VAL_SPLIT if args.val_split is None else args.val_split
        train, val = finetune_data.holdout(train, fraction, args.seed)
    normalize = finetune_data.Normalize.of(train.x)
    described = (
        f"{args.data}: {len(train)} train / {len(val)} held out, {len(train.classes)} classes "
        f"at {args.size}x{args.size}"
    )
    return (
        (normalize(train.x), train.y),
        (normalize(val.x), val.y),
        train.classes,
        normalize,
        described,
    )


def prepare(args: argparse.Namespace) -> Inputs:
    """Read and check everything the run needs; raises ``UsageError`` and friends."""
    if args.size <= 0 or args.batch <= 0:
        raise UsageError("--size and --batch must be positive")
    if args.optimizer == "adamw" and args.momentum is not None:
        raise UsageError("--momentum is SGD's: --optimizer adamw takes none")
    if args.scheme is None:
        args.scheme = finetune.QUANTIZED_SCHEME if args.quantize else "full"
    _warm_start_options(args)
    if args.quantize is not None:
        if args.scheme not in finetune.QUANTIZED_SCHEMES:
            raise UsageError(
                f"--scheme {args.scheme} with --quantize: it trains quantized weights; a "
                f"quantized backbone takes --scheme {' or '.join(finetune.QUANTIZED_SCHEMES)}"
            )
        if args.calibration_batches <= 0:
            raise UsageError("--calibration-batches must be positive")
    train, val, classes, normalize, described = _read_data(args)
    notes = [described]
    if args.model is not None:
        model = finetune.user_model(args.model, len(classes), args.seed)
    else:
        model = finetune.architecture(args.arch, classes=len(classes), seed=args.seed)
    if args.weights is not None:
        replaced = finetune.load_weights(model, args.weights)
        notes.append(f"weights: {args.weights}" + (f"; {replaced}" if replaced else ""))
    finetune.check_size(model, args.size)
    if len(train[1]) < args.batch:
        raise UsageError(f"{len(train[1])} training samples, fewer than one batch of {args.batch}")
    return Inputs(train, val, classes, normalize, model, notes, _fingerprint(*train, *val))


def _warm_start_options(args: argparse.Namespace) -> None:
    """``--head-epochs``, ``--head-lr`` and ``--lr`` with their defaults filled in, or
    ``UsageError``."""
    adapters_in_quantized = args.scheme == "adapter" and args.quantize is not None
    if args.head_epochs is None:
        args.head_epochs = 1 if adapters_in_quantized else 0
    if args.head_epochs < 0:
        raise UsageError(f"--head-epochs {args.head_epochs}: 0 or more")
    if args.head_epochs and args.scheme == "head":
        raise UsageError(
            f"--head-epochs {args.head_epochs} with --scheme head: it trains the head alone already"
        )
    if args.head_lr is not None and not args.head_epochs:
        raise UsageError("--head-lr is the warm start's rate: it needs --head-epochs 1 or more")
    if args.head_lr is None and args.head_epochs:
        args.head_lr = finetune.HEAD_LR
    if args.lr is None:
        warm = adapters_in_quantized and args.head_epochs
        args.lr = finetune.ADAPTER_LR if warm else DEFAULT_LR


def _check_out(args: argparse.Namespace) -> None:
    if args.out is None:
        for name in ("overwrite", "checkpoint_every", "external_weights"):
            if getattr(args, name):
                raise UsageError(f"--{name.replace('_', '-')} needs --out")
        return
    if args.out.exists() and not args.out.is_dir():
        raise UsageError(f"--out {args.out}: not a folder")
    held = [n for n in finetune.RUN_FILES if (args.out / n).exists()]
    if held and not args.resume and not args.overwrite:
        raise UsageError(
            f"--out {args.out} already holds a run ({', '.join(held)}): --resume {args.out} "
            "continues it, --overwrite replaces it"
        )


def _load_checkpoint(folder: Path) -> dict:
    path = folder / finetune.CHECKPOINT_FILE
    if not path.is_file():
        raise UsageError(f"--resume {folder}: no {finetune.CHECKPOINT_FILE} there")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated or foreign
        raise UsageError(f"{path}: not readable ({type(err).__name__}: {err})") from None
    kind = state.get("format") if isinstance(state, dict) else None
    if isinstance(kind, str) and kind.startswith("qnn-convbwd finetune checkpoint"):
        if kind != finetune.CHECKPOINT_FORMAT:
            raise UsageError(
                f"{path}: a checkpoint of format {kind!r}; this version resumes "
                f"{finetune.CHECKPOINT_FORMAT!r} (start the run again)"
            )
    else:
        raise UsageError(f"{path}: not a checkpoint of qnn-convbwd finetune")
    return state


# Options a checkpoint stores; --resume runs with these.
STORED = (
    "data",
    "val",
    "val_split",
    "size",
    "arch",
    "model",
    "weights",
    "scheme",
    "quantize",
    "calibration_batches",
    "batch",
    "steps",
    "epochs",
    "eval_every",
    "lr",
    "head_epochs",
    "head_lr",
    "lr_schedule",
    "optimizer",
    "momentum",
    "weight_decay",
    "soc",
    "seed",
    "cpu",
    "no_torch",
    "torch_masks",
    "eval_mode",
    "checkpoint_every",
    "external_weights",
    "png",
)


def _stored_args(args: argparse.Namespace) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k in STORED}


def _restore_args(args: argparse.Namespace, stored: dict) -> argparse.Namespace:
    paths = {"data", "val", "weights", "png"}
    values = {k: Path(v) if k in paths and v is not None else v for k, v in stored.items()}
    return argparse.Namespace(**{**vars(args), **values, "out": args.resume, "overwrite": False})


# --- progress -------------------------------------------------------------------------


class Progress:
    """``fit``'s progress: a tqdm bar on a terminal (loss, accuracy and time left beside
    it), and a line at each evaluation and every twentieth of the run: step, epoch, mean
    training loss since the previous line, held-out accuracy, program next to torch, and
    the time left."""

    def __init__(self, bar: bool, torch_reference: bool = True) -> None:
        self.show_bar = bar
        self.torch_reference = torch_reference
        self.bar = None
        self.since = None  # steps done at the previous line
        self.started: tuple[float, int] | None = None  # (time, steps) at the first step

    def header(self) -> str:
        torch_columns = f"  {'loss torch':>12}" if self.torch_reference else ""
        torch_accuracy = f"  {'acc torch':>9}" if self.torch_reference else ""
        return (
            f"{'step':>6}  {'epoch':>6}  {'loss program':>12}{torch_columns}  "
            f"{'acc program':>11}{torch_accuracy}  {'left':>8}"
        )

    def left(self, done: int, total: int) -> float:
        """Seconds left at the mean pace of the steps this process ran (NaN before two)."""
        now = time.perf_counter()
        if self.started is None:
            self.started = (now, done)
            return math.nan
        seconds, steps = now - self.started[0], done - self.started[1]
        return seconds / steps * (total - done) if steps > 0 else math.nan

    def __call__(
        self, result: finetune.FitResult, total: int, evaluation: finetune.Evaluation | None
    ) -> None:
        done = len(result.steps)
        if self.since is None:
            self.since = done
        left = self.left(done, total)
        if self.show_bar and self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total, initial=done, desc="training", unit="step", file=sys.stdout
            )
        if self.bar is not None and result.steps:
            self.bar.update(done - self.bar.n)
            accuracy = result.evaluations[-1].program_accuracy if result.evaluations else math.nan
            self.bar.set_postfix(
                loss=f"{result.steps[-1].program_loss:.4f}", acc=f"{100 * accuracy:.1f}%"
            )
        every = max(1, total // 20)
        if evaluation is None and (done == 0 or done % every or self.bar is not None):
            return
        recent = result.steps[self.since : done]
        self.since = done
        line = self.line(result, done, total, recent, evaluation, left)
        if self.bar is not None:
            self.bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def line(
        self,
        result: finetune.FitResult,
        done: int,
        total: int,
        recent: list,
        evaluation: finetune.Evaluation | None,
        left: float,
    ) -> str:
        def mean(values: list[float]) -> str:
            return f"{sum(values) / len(values):>12.4f}" if values else f"{'-':>12}"

        def percent(value: float | None, width: int) -> str:
            return f"{'-':>{width}}" if value is None else f"{100 * value:>{width - 1}.1f}%"

        epoch = f"{evaluation.epoch:>6.2f}" if evaluation else f"{'':>6}"
        columns = [f"{done:>6}", epoch]
        columns.append(mean([s.program_loss for s in recent]))
        if self.torch_reference:
            columns.append(mean([s.torch_loss for s in recent]))
        columns.append(percent(evaluation and evaluation.program_accuracy, 11))
        if self.torch_reference:
            columns.append(percent(evaluation and evaluation.torch_accuracy, 9))
        columns.append(f"{_duration(left):>8}")
        return "  ".join(columns)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _duration(seconds: float) -> str:
    if seconds != seconds:  # NaN: not known yet
        return "-"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def phase_report(result: finetune.FitResult) -> list[dict[str, Any]]:
    """Each phase that ran (``FitResult.phases``) with the accuracies after its last
    step."""
    found = []
    for phase in result.phases:
        end = phase.first + phase.steps
        after = next((e for e in result.evaluations if e.step == end), None)
        found.append(
            {
                **dataclasses.asdict(phase),
                "program_accuracy": after.program_accuracy if after else None,
                "torch_accuracy": after.torch_accuracy if after else None,
            }
        )
    return found


def phase_lines(result: finetune.FitResult) -> list[str]:
    """One line per phase: what trained, its steps, its optimizer and rates, the
    accuracies after it."""
    lines = []
    for number, phase in enumerate(phase_report(result), 1):
        trains = "the head alone" if phase["trains"] == "head" else f"scheme {phase['trains']}"
        hyper = ", ".join(
            f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}"
            for k, v in phase["optimizer"].items()
            if k not in ("name", "dampening", "nesterov")
        )
        line = (
            f"phase {number}, {trains}: steps {phase['first'] + 1}-"
            f"{phase['first'] + phase['steps']}, {phase['optimizer']['name']} {hyper}"
            f", schedule {phase['lr_schedule']}, {phase['trainable']} trained elements"
        )
        if phase["program_accuracy"] is not None:
            line += f"; after it {100 * phase['program_accuracy']:.1f}% (program)"
            if result.torch_reference:
                line += f", {100 * phase['torch_accuracy']:.1f}% (torch)"
        lines.append(line)
    return lines


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
    step_time = f"step time: {1000 * result.mean_step_seconds:.1f} ms (program)"
    if result.torch_reference:
        step_time += f", {1000 * result.mean_torch_step_seconds:.1f} ms (torch eager)"
    lines.append(
        step_time + ", mean after the first" + (" of each phase" if len(result.phases) > 1 else "")
    )
    lines += phase_lines(result)
    final = result.evaluations[-1]
    accuracy = (
        f"held-out accuracy after {final.step} steps: {100 * final.program_accuracy:.1f}% (program)"
    )
    if result.torch_reference:
        gap = 100 * (final.program_accuracy - final.torch_accuracy)
        accuracy += f", {100 * final.torch_accuracy:.1f}% (torch), {gap:+.1f} points"
    lines.append(accuracy)
    if result.dropped_per_epoch:
        lines.append(
            f"{result.dropped_per_epoch} training samples past the last full batch of "
            f"{result.batch} are left out of each epoch"
        )
    lines.append(f"curves: {png}" if png else "curves: not drawn")
    return lines


# --- outputs --------------------------------------------------------------------------


def write_outputs(
    args: argparse.Namespace,
    inputs: Inputs,
    result: finetune.FitResult,
    png: Path | None,
    seconds: dict[str, float],
) -> list[str]:
    """model.pt, train.pte (+ .ptd), infer.pte and report.json under ``args.out``, each
    written atomically; returns the lines to print."""
    out: Path = args.out
    finetune.save_atomic(out / "model.pt", result.program_state)
    start = time.perf_counter()
    pte, ptd = finetune.trained_program(result)
    finetune.write_atomic(out / "train.pte", pte)
    if ptd is not None:
        finetune.write_atomic(out / "train.ptd", ptd)
    else:
        (out / "train.ptd").unlink(missing_ok=True)
    seconds["emit_train_pte"] = time.perf_counter() - start
    if result.quantization is not None:
        # The quantized backbone as calibrated, under the trained head.
        trained = result.trained
    else:
        trained = finetune.apply_scheme(copy.deepcopy(inputs.model), args.scheme)
        trained.load_state_dict(result.program_state)
    inference = finetune.lower_inference(trained, inputs.val[0][:1], result.soc)
    seconds["lower_infer_pte"] = inference.lowering_seconds
    finetune.write_atomic(out / "infer.pte", inference.pte)
    final = result.evaluations[-1]
    report = {
        "val_accuracy": final.program_accuracy,
        "torch_val_accuracy": final.torch_accuracy if result.torch_reference else None,
        "steps": len(result.steps),
        "classes": inputs.classes,
        "normalize": {
            "mean": inputs.normalize.mean,
            "std": inputs.normalize.std,
            "applied_to": "pixels in [0, 1], (x - mean) / std per channel",
        },
        "input": [1, 3, args.size, args.size],
        "soc": result.soc,
        "quantization": result.quantization,
        "optimizer": result.optimizer,
        # The phases that ran: the head alone first with --head-epochs, then --scheme.
        "phases": phase_report(result),
        # What training.ProgramOptimizer.from_dict reads to open train.pte in a session.
        "program_optimizer": result.program.optimizer.as_dict(),
        "delegates": {"train": result.delegates, "infer": inference.delegates},
        "losses": [s.program_loss for s in result.steps],
        "torch_losses": [s.torch_loss for s in result.steps] if result.torch_reference else None,
        "evaluations": [dataclasses.asdict(e) for e in result.evaluations],
        "seconds": seconds,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "files": {},
    }
    report["files"] = {
        n: (out / n).stat().st_size
        for n in ("model.pt", "train.pte", "train.ptd", "infer.pte")
        if (out / n).exists()
    }
    if png is not None:
        report["files"]["curves.png"] = png.stat().st_size
    finetune.write_atomic(
        out / "report.json",
        (json.dumps(_json_safe(report), indent=1, allow_nan=False) + "\n").encode(),
    )
    return [
        f"{out}: model.pt, {'train.pte + train.ptd' if ptd else 'train.pte'}, infer.pte "
        f"({inference.delegates} delegate(s)), report.json"
    ]


def _json_safe(value: Any) -> Any:
    """``value`` with NaN (a value not measured: torch's, without a torch copy) as None."""
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


# --- the command ----------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    from ..toolchain import SdkUnavailable, ensure_sdk
    from ..torchvision_import import TorchvisionUnavailable

    checkpoint = None
    try:
        if args.resume is not None:
            checkpoint = _load_checkpoint(args.resume)
            args = _restore_args(args, checkpoint["args"])
        _check_out(args)
        inputs = prepare(args)
        if checkpoint is not None and checkpoint.get("fingerprint") != inputs.fingerprint:
            raise UsageError(
                f"--resume {args.resume}: the data read now differs from the run's "
                "(files changed since it started)"
            )
        # The CPU-only program is lowered through the QNN partitioner too (for SM8350).
        ensure_sdk()
    except (
        UsageError,
        finetune_data.DataError,
        finetune.ModelError,
        finetune.MissingDependency,
        TorchvisionUnavailable,
        SdkUnavailable,
        ValueError,
    ) as err:
        print(f"qnn-convbwd finetune: {err}", file=sys.stderr)
        return 2
    # Nothing was written before this point.
    png = args.png
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        # Temporary files of a run killed while it wrote one (finetune.write_atomic).
        for stale in [*args.out.glob(".*.tmp"), *args.out.glob(".*.tmp.png")]:
            stale.unlink(missing_ok=True)
        if args.overwrite:
            for name in finetune.RUN_FILES:
                (args.out / name).unlink(missing_ok=True)
        png = png or args.out / "curves.png"
    png = png or Path("out/finetune.png")
    if args.optimizer == "sgd" and args.momentum is None:
        args.momentum = DEFAULT_MOMENTUM
    chosen = finetune.describe_optimizer(
        finetune.program_optimizer(args.optimizer, args.lr, args.momentum, args.weight_decay)
    )
    hyper = ", ".join(
        f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}"
        for k, v in chosen.items()
        if k not in ("name", "lr", "dampening", "nesterov")
    )
    name = args.model or args.arch
    mode = "eval()" if args.eval_mode else "train()"
    where = "CPU-only program" if args.cpu else f"{args.soc} on the HTP simulator"
    print(
        f"qnn-convbwd finetune: {name}, scheme {args.scheme}, in {mode}, {where}; "
        + (
            f"backbone quantized {args.quantize} on {args.calibration_batches} training batches; "
            if args.quantize
            else ""
        )
        + f"batch {args.batch}, {args.optimizer} in the program, lr {args.lr:g} "
        f"({args.lr_schedule}), {hyper}"
        + (
            f"; first {args.head_epochs} epoch(s) of the head alone at lr {args.head_lr:g}, "
            f"then {args.scheme} with a fresh optimizer"
            if args.head_epochs
            else ""
        )
        + ("; no torch copy" if args.no_torch else "")
        + (
            ""
            if args.eval_mode or args.no_torch
            else f"; torch's dropout masks: {args.torch_masks}"
        )
    )
    for note in inputs.notes:
        print(note)
    if checkpoint is not None:
        print(f"resuming {args.resume} after step {checkpoint['step']} of {checkpoint['total']}")

    def save_checkpoint(state: dict) -> None:
        state.update(
            args=_stored_args(args),
            fingerprint=inputs.fingerprint,
            normalize=dataclasses.asdict(inputs.normalize),
            classes=inputs.classes,
        )
        finetune.save_atomic(args.out / finetune.CHECKPOINT_FILE, state)

    progress = Progress(
        bar=sys.stdout.isatty() and not args.no_progress, torch_reference=not args.no_torch
    )
    print(progress.header())
    started = time.perf_counter()
    try:
        result = finetune.fit(
            inputs.model,
            inputs.train,
            inputs.val,
            scheme=args.scheme,
            soc=args.soc,
            batch=args.batch,
            steps=args.steps,
            epochs=args.epochs,
            lr=args.lr,
            momentum=args.momentum,
            weight_decay=args.weight_decay,
            optimizer=args.optimizer,
            seed=args.seed,
            cpu_only=args.cpu,
            train_mode=not args.eval_mode,
            torch_masks=args.torch_masks,
            eval_every=args.eval_every,
            on_progress=progress,
            torch_reference=not args.no_torch,
            lr_schedule=args.lr_schedule,
            checkpoint_every=args.checkpoint_every,
            on_checkpoint=save_checkpoint if args.out is not None else None,
            resume=checkpoint,
            external_weights=args.external_weights,
            quantize=args.quantize,
            calibration_batches=args.calibration_batches,
            head_epochs=args.head_epochs,
            head_lr=args.head_lr if args.head_epochs else finetune.HEAD_LR,
        )
    except finetune.QuantizationMismatch as err:
        print(f"qnn-convbwd finetune: --resume {args.resume}: {err}", file=sys.stderr)
        return 2
    finally:
        progress.close()
    seconds = {
        "lowering_train": result.lowering_seconds,
        "training": time.perf_counter() - started - result.lowering_seconds,
    }
    result.name = name
    try:
        png = finetune.plot_atomic(result, png) if args.out else result.plot(png)
    except finetune.MissingDependency as err:
        print(f"curves not drawn: {err}")
        png = None
    lines = summary(result, png)
    if args.out is not None:
        lines += write_outputs(args, inputs, result, png, seconds)
    for line in lines:
        print(line)
    return 0
