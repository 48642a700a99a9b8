"""``qnn-convbwd train``: fine-tune a model on the HTP simulator next to torch.

Lowers the model's joint training graph with the plugin, loads the program
with ExecuTorch's ``TrainingModule`` and runs ``--steps`` SGD steps on the
simulator, and the same steps in torch eager + ``torch.optim.SGD`` from the
same weights; prints the loss of each step side by side and writes a PNG of
both curves.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

from .. import api, training
from ..toolchain import harness
from . import models

# model -> (default learning rate, what it is)
MODELS = {
    "cifar": (
        0.05,
        "ExecuTorch's CIFAR-10 example CNN (3 conv + max pool, 2 linear), cross-entropy",
    ),
    "demo": (0.1, "1x1 adapter + plain, strided and depthwise convolutions, MSE"),
    "resnet": (0.1, "adapter + ResNet-like basic blocks, MSE"),
    "mobilenet": (0.1, "adapter + MobileNetV2-like inverted residuals, MSE"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=sorted(MODELS), default="cifar")
    add_training_arguments(parser)


def add_training_arguments(
    parser: argparse.ArgumentParser, steps: int = 5, trainable: bool = False
) -> None:
    parser.add_argument("--soc", default="SM8650", help="target SoC (default SM8650, HTP V75)")
    parser.add_argument("--steps", type=int, default=steps, help=f"SGD steps (default {steps})")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (model default)")
    scheme = parser.add_mutually_exclusive_group()
    scheme.add_argument(
        "--frozen",
        dest="trainable",
        action="store_false",
        help="frozen backbone behind a trainable 1x1 adapter" + ("" if trainable else " (default)"),
    )
    scheme.add_argument(
        "--trainable",
        dest="trainable",
        action="store_true",
        help="every parameter trainable" + (" (default)" if trainable else ""),
    )
    parser.set_defaults(trainable=trainable)
    parser.add_argument("--out", type=Path, default=Path("out"), help="where to write .pte / .png")


def lower_case(case: models.TrainingCase, soc: str):
    """(LoweringResult, .pte bytes, lowering seconds) for a training case."""
    start = time.perf_counter()
    result = api.lower(case.joint(), harness.compile_specs(soc))
    pte = result.edge.to_executorch().buffer
    return result, pte, time.perf_counter() - start


def cpu_ops(edge) -> list[str]:
    """Names of the ops the lowered program runs on CPU (outside every delegate)."""
    names = []
    for node in edge.exported_program().graph.nodes:
        if node.op != "call_function":
            continue
        name = getattr(node.target, "__name__", str(node.target))
        if "executorch_call_delegate" in name or name in ("getitem", "alloc"):
            continue
        names.append(name.split(".")[0])
    return sorted(set(names))


def print_steps(run: training.TrainingRun) -> None:
    print(f"{'step':>4}  {'loss (HTP)':>12}  {'loss (torch)':>12}  {'gap':>9}  {'seconds':>7}")
    for index, step in enumerate(run.steps):
        gap = abs(step.loss - step.reference_loss)
        print(
            f"{index:>4}  {step.loss:>12.6f}  {step.reference_loss:>12.6f}  {gap:>9.2e}  "
            f"{step.seconds:>7.2f}"
        )
    print(
        f"update theta_N - theta_0 vs torch: cosine {run.update_cosine():.6f}, "
        f"norm ratio {run.update_norm_ratio():.4f}"
    )


_PLOT = """
import json, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
data = json.load(sys.stdin)
steps = range(len(data["torch"]))
figure, axes = plt.subplots(figsize=(6, 3.5))
axes.plot(steps, data["torch"], "o-", label="torch eager fp32 + SGD")
axes.plot(steps, data["htp"], "x--", label="ExecuTorch TrainingModule, HTP")
axes.set_xticks(list(steps))
axes.set_xlabel("step")
axes.set_ylabel("loss")
axes.set_title(data["title"], fontsize=9)
axes.legend()
figure.tight_layout()
figure.savefig(data["path"], dpi=100)
"""


def plot(run: training.TrainingRun, title: str, path: Path) -> Path | None:
    """PNG of both loss curves; None when matplotlib is not installed.

    Drawn in a child process: importing matplotlib into a process where
    executorch's runtime has loaded the QNN libraries crashes it (measured with
    matplotlib 3.11, executorch 1.5.1: a segfault in matplotlib's font module
    import, also without this plugin's code on the path).
    """
    if importlib.util.find_spec("matplotlib") is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "torch": [s.reference_loss for s in run.steps],
        "htp": [s.loss for s in run.steps],
        "title": title,
        "path": str(path),
    }
    done = subprocess.run(
        [sys.executable, "-c", _PLOT], input=json.dumps(data), capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"plotting failed: {done.stderr[-1000:]}")
    return path


def train_and_report(case: models.TrainingCase, args, lr: float) -> training.TrainingRun:
    result, pte, seconds = lower_case(case, args.soc)
    report = result.report
    print(
        f"lowered in {seconds:.1f} s: {harness.delegate_count(result.edge)} delegate(s), "
        f"convolution_backward {report.delegated} of {len(report.rows)} delegated"
    )
    for row in report.rows:
        if not row.delegated:
            print(f"  kept on CPU: {row.node}: {row.summary}")
    print(f"on CPU: {', '.join(cpu_ops(result.edge)) or 'nothing'}")
    args.out.mkdir(parents=True, exist_ok=True)
    pte_path = args.out / f"{case.name}-{args.soc}.pte"
    pte_path.write_bytes(pte)
    context = sum(len(b) for b in harness.context_binaries(result.edge))
    print(f"QNN context binaries {context} bytes; .pte {len(pte)} bytes -> {pte_path}")
    run = training.train_side_by_side(pte, case.model, case.inputs, args.steps, lr)
    print_steps(run)
    png = plot(run, f"{case.name} on {args.soc}", args.out / f"{case.name}-{args.soc}.png")
    print(f"loss curves -> {png}" if png else "loss curves: matplotlib not installed")
    return run


def run(args: argparse.Namespace) -> int:
    default_lr, about = MODELS[args.model]
    case = models.TRAINING_MODELS[args.model](args.trainable)
    scheme = "all parameters trainable" if args.trainable else "frozen backbone + adapter"
    print(f"qnn-convbwd train: {case.name} ({about}; {scheme}) for {args.soc}")
    train_and_report(case, args, default_lr if args.lr is None else args.lr)
    return 0
