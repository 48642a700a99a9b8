"""Train models with ExecuTorch's TrainingModule on the HTP simulator; print a table.

Per model, scheme and SoC: delegates, the ops left on CPU, the per-step loss of
the lowered program next to torch eager + SGD, the update's cosine and norm
ratio against torch's, the lowering time, one step's wall time on the
simulator and of the CPU-only program (no delegate), and the context-binary
and .pte bytes. Built on the public API (``qnn_convbwd.lower``,
``qnn_convbwd.training``).

    python scripts/train_report.py --models cifar demo --socs SM8650 SM8850 --steps 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from qnn_convbwd import MaxPoolBackwardOnCpu, training
from qnn_convbwd.commands import train_cli
from qnn_convbwd.toolchain import harness
from qnn_convbwd_dev import models


def cpu_only_step_seconds(case: models.TrainingCase, steps: int, lr: float) -> float:
    """Median wall time of one step of the program without any delegate."""
    from executorch.exir import EdgeCompileConfig, to_edge

    edge = to_edge(case.joint(), compile_config=EdgeCompileConfig(_check_ir_validity=False))
    edge = edge.transform([MaxPoolBackwardOnCpu()])  # executorch 1.5.1's kernel defect
    run = training.train_side_by_side(
        edge.to_executorch().buffer, case.model, case.inputs, steps, lr
    )
    return statistics.median(s.seconds for s in run.steps)


def measure(name: str, trainable: bool, soc: str, steps: int) -> dict:
    lr, _ = train_cli.MODELS[name]
    case = models.TRAINING_MODELS[name](trainable)
    result, pte, lower_seconds = train_cli.lower_case(case, soc)
    start = time.perf_counter()
    run = training.train_side_by_side(pte, case.model, case.inputs, steps, lr)
    return {
        "model": case.name,
        "soc": soc,
        "delegates": harness.delegate_count(result.edge),
        "convolution_backward": f"{result.report.delegated}/{len(result.report.rows)}",
        "cpu_ops": train_cli.cpu_ops(result.edge),
        "losses": [[s.loss, s.reference_loss] for s in run.steps],
        "worst_loss_gap": run.worst_loss_gap(),
        "update_cosine": run.update_cosine(),
        "update_norm_ratio": run.update_norm_ratio(),
        "lower_seconds": lower_seconds,
        "step_seconds": statistics.median(s.seconds for s in run.steps),
        "train_seconds": time.perf_counter() - start,
        "context_bytes": sum(len(b) for b in harness.context_binaries(result.edge)),
        "pte_bytes": len(pte),
        "cpu_only_step_seconds": cpu_only_step_seconds(case, steps, lr),
    }


def markdown(rows: list[dict]) -> str:
    head = (
        "| model | SoC | delegates | conv bwd | on CPU | loss gap | update cos | norm ratio "
        "| lower s | step s (HTP sim) | step s (CPU only) | context B | .pte B |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [
        f"| {r['model']} | {r['soc']} | {r['delegates']} | {r['convolution_backward']} | "
        f"{', '.join(r['cpu_ops'])} | {r['worst_loss_gap']:.1e} | {r['update_cosine']:.5f} | "
        f"{r['update_norm_ratio']:.4f} | {r['lower_seconds']:.1f} | {r['step_seconds']:.2f} | "
        f"{r['cpu_only_step_seconds']:.3f} | {r['context_bytes']} | {r['pte_bytes']} |"
        for r in rows
    ]
    return "\n".join([head, *lines])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["cifar"], choices=sorted(train_cli.MODELS))
    parser.add_argument("--socs", nargs="+", default=["SM8650", "SM8850"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    rows = []
    for name in args.models:
        for trainable in (True, False):
            for soc in args.socs:
                row = measure(name, trainable, soc, args.steps)
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
