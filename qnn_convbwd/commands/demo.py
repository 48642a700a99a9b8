"""``qnn-convbwd demo``: train a small CNN on the HTP simulator, next to torch.

The model is ``models.adapter_case("demo")``: a 1x1 adapter in front of
plain, strided (odd input size) and depthwise convolutions, trained with an
MSE loss; every convolution trainable (``--frozen``: only the adapter). On the HTP
backend (default when usable) the joint graph is lowered with the plugin,
loaded with ExecuTorch's ``TrainingModule`` and trained for ``--steps`` SGD
steps on the x86-64 HTP simulator next to torch eager; otherwise the Saver
backend records the QNN graph instead.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import logging
from typing import Any

import torch

from .. import api
from ..toolchain import SdkUnavailable, ensure_sdk, harness
from . import models, train_cli

logger = logging.getLogger(__name__)

LR = 1.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        choices=["auto", "htp", "saver"],
        default="auto",
        help="auto: the HTP simulator when usable, else the Saver backend",
    )
    parser.add_argument("--size", type=int, default=15, help="input height/width (odd by default)")
    train_cli.add_training_arguments(parser, trainable=True)


@dataclasses.dataclass
class QnnGraphSummary:
    op_counts: dict[str, int]
    static_bytes: int

    def describe(self) -> str:
        ops = ", ".join(f"{k} x{v}" for k, v in sorted(self.op_counts.items()))
        return (
            f"{sum(self.op_counts.values())} ops ({ops}); static tensors {self.static_bytes} bytes"
        )


def summarize(graphs: list[list[Any]]) -> QnnGraphSummary:
    """Op counts and bytes of distinct static tensors over captured QNN graphs."""
    counts: collections.Counter = collections.Counter()
    static: dict[str, int] = {}
    for ops in graphs:
        for op in ops:
            counts[op.op_type] += 1
            for tensor in op.inputs:
                if tensor.is_static:
                    static[tensor.name] = tensor.nbytes
    return QnnGraphSummary(dict(counts), sum(static.values()))


def _header(case: models.TrainingCase, soc: str, trainable: bool) -> str:
    arch = harness.SOC_ARCH.get(soc)
    scheme = "all convolutions trainable" if trainable else "frozen backbone, trainable adapter"

    return (
        f"qnn-convbwd demo: '{case.name}' ({scheme}) for {soc}{f' (HTP V{arch})' if arch else ''}"
    )


def run_htp(case: models.TrainingCase, args: argparse.Namespace) -> int:
    print(f"backend: HTP simulator ({describe_sdk()})")
    run = train_cli.train_and_report(case, args, LR if args.lr is None else args.lr)
    worst = run.worst_loss_gap()
    print(f"worst loss gap vs torch: {worst:.2e} (of max(1, |loss|))")
    return 0


def run_saver(case: models.TrainingCase, soc: str, reason: str) -> int:
    from ..toolchain import saver

    print(f"backend: Saver ({reason})")
    program = case.joint()
    report = api.decide(program, harness.compile_specs(soc))
    print(f"convolution_backward nodes: {report.delegated} of {len(report.rows)} to be delegated")
    recording = saver.record(program, soc)
    counts = collections.Counter(op.type for op in recording.ops)
    ops = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
    print(f"QNN graph (Saver recording, first partition): {len(recording.ops)} ops ({ops})")
    print(f"static tensors: {recording.static_bytes} bytes")
    print("training: not run (the Saver backend records QNN API calls; it does not execute)")
    return 0


def describe_sdk() -> str:
    info = ensure_sdk()
    shim = "shim in use" if info.shim else "no shim"
    return f"QAIRT {info.build_id}, {info.source}, {shim}"


def htp_unusable_reason(soc: str) -> str | None:
    """None when an HTP compile works here; otherwise why not."""
    try:
        ensure_sdk()
        harness.lower_module(torch.nn.Conv2d(2, 2, 1), (torch.randn(1, 2, 4, 4),), soc)
    except (SdkUnavailable, RuntimeError, AssertionError) as err:
        return f"HTP unusable: {str(err).splitlines()[0]}"
    return None


def run(args: argparse.Namespace) -> int:
    case = models.adapter_case("demo", args.trainable, size=args.size)
    print(_header(case, args.soc, args.trainable))
    reason = None if args.backend == "htp" else htp_unusable_reason(args.soc)
    if args.backend == "saver":
        reason = "selected with --backend saver"
    if reason is None:
        return run_htp(case, args)
    return run_saver(case, args.soc, reason)
