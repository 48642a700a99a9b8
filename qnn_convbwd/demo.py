"""``qnn-convbwd demo``: lower a frozen-backbone training graph and show what happened.

The graph is ``models.training_graph("demo")``: a trainable 1x1 adapter in
front of frozen plain, strided (odd input size) and depthwise convolutions,
trained with an MSE loss. On the HTP backend (default when usable) the program
is compiled, run on the x86-64 HTP simulator and compared with torch autograd;
otherwise the Saver backend records the QNN graph instead.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import torch

from . import api, integration, models
from .toolchain import SdkUnavailable, ensure_sdk, harness

logger = logging.getLogger(__name__)

CONV_BWD = "aten.convolution_backward.default"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--soc", default="SM8650", help="target SoC (default SM8650, HTP V75)")
    parser.add_argument(
        "--backend",
        choices=["auto", "htp", "saver"],
        default="auto",
        help="auto: the HTP simulator when usable, else the Saver backend",
    )
    parser.add_argument("--size", type=int, default=15, help="input height/width (odd by default)")
    parser.add_argument("--out", type=Path, default=Path("out"), help="where to write the .pte")


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


def _header(graph: models.TrainingGraph, soc: str) -> str:
    arch = harness.SOC_ARCH.get(soc)
    return (
        f"qnn-convbwd demo: training graph '{graph.name}' for {soc}"
        f"{f' (HTP V{arch})' if arch else ''}"
    )


def run_htp(graph: models.TrainingGraph, soc: str, out: Path) -> int:
    with integration.capture_qnn_graphs() as graphs:
        compiled = harness.lower_program(graph.program, soc)
    kept = harness.lower_program(graph.program, soc, skip_node_op_set={CONV_BWD})
    report = compiled.report
    print(f"backend: HTP ({describe_sdk()})\n")
    print(f"convolution_backward nodes: {report.delegated} of {len(report.rows)} delegated")
    print(report.to_markdown())
    print()
    delegates = harness.delegate_count(compiled.edge)
    print(f"QNN graph: {delegates} delegate(s), {summarize(graphs).describe()}")
    print(f"context binary: {compiled.context_binary_bytes} bytes")
    out.mkdir(parents=True, exist_ok=True)
    pte = out / f"demo-{soc}.pte"
    pte.write_bytes(compiled.pte)
    print(f".pte: {len(compiled.pte)} bytes, written to {pte}")
    kept_cpu = sum(not r.delegated for r in kept.report.rows)
    print(
        f"lowering: {compiled.lower_seconds:.2f} s with the plugin; {kept.lower_seconds:.2f} s "
        f"with convolution_backward kept on CPU ({harness.delegate_count(kept.edge)} delegate(s), "
        f"{kept_cpu} convolution_backward on CPU)"
    )
    reference = graph.reference()
    start = time.perf_counter()
    outputs = compiled.run(graph.inputs)[: len(reference)]
    seconds = time.perf_counter() - start
    errors = [(a - b).abs().max().item() for a, b in zip(outputs, reference, strict=True)]
    names = [s.target or s.kind.name.lower() for s in graph.program.graph_signature.output_specs]
    print(
        f"simulator ({seconds:.2f} s): max abs error vs torch autograd {max(errors):.3g} "
        f"(" + ", ".join(f"{n}: {e:.2g}" for n, e in zip(names, errors, strict=True)) + ")"
    )
    return 0


def run_saver(graph: models.TrainingGraph, soc: str, reason: str) -> int:
    from .toolchain import saver

    print(f"backend: Saver ({reason})\n")
    report = api.decide(graph.program, harness.compile_specs(soc))
    print(f"convolution_backward nodes: {report.delegated} of {len(report.rows)} to be delegated")
    print(report.to_markdown())
    recording = saver.record(graph.program, soc)
    counts = collections.Counter(op.type for op in recording.ops)
    ops = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
    print(f"\nQNN graph (Saver recording, first partition): {len(recording.ops)} ops ({ops})")
    print(f"static tensors: {recording.static_bytes} bytes")
    print("simulator: not run (the Saver backend records QNN API calls; it does not execute)")
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
    graph = models.training_graph("demo", size=args.size)
    print(_header(graph, args.soc))
    reason = None if args.backend == "htp" else htp_unusable_reason(args.soc)
    if args.backend == "saver":
        reason = "selected with --backend saver"
    if reason is None:
        return run_htp(graph, args.soc, args.out)
    return run_saver(graph, args.soc, reason)
