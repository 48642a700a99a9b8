"""Fidelity of torchvision models' training steps on the HTP simulator.

For each architecture, scheme and size (``tests/zoo.graph``: random weights,
batch-norm statistics from random batches, the scheme's parameters trained, MSE):
lower the joint graph for a SoC with ``qnn_convbwd.lower``, run it on the x86-64
HTP simulator, judge every output with ``qnn_convbwd_dev.fidelity`` against torch
fp32 and fp16. Prints one markdown row per graph (and, with ``--tensors``, the
full per-tensor report). On a V68 SoC (SM8350) nothing is delegated and the
program runs on ExecuTorch's CPU kernels: the row then checks those.

    PYTHONPATH=. python scripts/zoo_fidelity.py [arch ...] [--soc SM8650] [--scheme bias_only]
        [--size 32] [--tensors] [--set OPTION=VALUE ...]

(the architectures first: ``--size`` and the others take several values.)

``--spread DRAWS`` adds a column: how many tensors are ill-conditioned
(``fidelity.input_spread``: an fp32 step with its input moved by one fp16
rounding is already outside the limit), and how many of those are outside.

``--set`` lowers with ``qnn_convbwd.enabled(OPTION=VALUE)`` (e.g.
``mul_over_add=keep``; numbers are parsed as floats).

``--inputs K`` runs the lowered program on the graph's own input and K - 1 more
(``zoo.more_inputs``: seeded normal inputs and targets of the same shapes) and
judges each tensor's errors pooled over the K inputs (``fidelity.pooled``);
the "within" column then also says on how many inputs alone the step is within.

``--neighbours K`` pools over the graph's input and K - 1 copies of it moved by
at most one fp16 rounding (``fidelity.neighbours``): the same step as far as
fp16 can tell, so the pooled floor is torch fp16's typical error on it rather
than one draw (docs/numerics.md). The input's own verdict is printed beside.

``--why`` explains every tensor outside the bound, after the table: torch's
fp32 and fp16 step on the graph's input (``qnn_convbwd_dev.kinks``, CPU) finds the gate
elements next to a kink, and a tensor is explained when one such element,
flipped alone, moves its gradient past the judge's limit on it
(``kinks.explain``); otherwise the largest flip that reaches it is named.

``--gates`` judges each graph again with each side's own gate decisions
(``zoo.gate_matched``, on the input and its ``--neighbours``): the joint graph is
lowered a second time with every gate's compared tensor as an output (its other
outputs checked bit-identical to the first lowering's), and the HTP is compared
with fp32 on the HTP's gates, torch fp16 with fp32 on fp16's. Within there and outside in the
table: the HTP's arithmetic is as right as fp16's, and which gate elements its
forward rounded across a kink puts it outside.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import qnn_convbwd
from qnn_convbwd.commands.train_cli import cpu_ops
from qnn_convbwd.toolchain import harness
from qnn_convbwd_dev import fidelity, zoo


def measure(
    arch: str,
    scheme: str,
    soc: str,
    size: int,
    inputs: int = 1,
    spread: int = 0,
    neighbours: int = 0,
    dump: str | None = None,
    gates: bool = False,
) -> tuple[str, fidelity.Report, list[tuple[str, fidelity.Report]], list[str]]:
    """The graph's markdown row, its report, each judge's report (label, report),
    and with ``gates`` the lines of its gate-matched judgement."""
    start = time.perf_counter()
    graph = zoo.graph(arch, scheme, size)
    export_s = time.perf_counter() - start
    compiled = harness.lower_program(graph.program, soc)
    start = time.perf_counter()
    if neighbours:
        reports = zoo.reports(graph, compiled, neighbours, around=True)
    else:
        reports = zoo.reports(graph, compiled, inputs)
    run_s = time.perf_counter() - start
    if dump:
        draws = [
            {r.name: [r.htp.rel_l2, r.htp.cosine, r.floor.rel_l2, r.floor.cosine] for r in rep.rows}
            for rep in reports
        ]
        path = Path(dump.format(arch=arch, scheme=scheme, size=size, soc=soc))
        path.write_text(json.dumps(draws))
    judges = zoo.judges(reports, around=bool(neighbours))
    report = judges[0][1]
    matched_lines = []
    if gates:
        first = compiled.run(list(graph.inputs))
        matched = zoo.gate_matched(graph, soc, max(neighbours, 1), first)
        flips = [(sum(m.flips_htp.values()), sum(m.flips_fp16.values())) for m in matched]
        matched_lines.append(
            f"**{arch} {scheme} {size} px {soc}** on each side's own gates; slopes flipped "
            f"per draw (HTP / torch fp16): {', '.join(f'{h}/{f}' for h, f in flips)}"
        )
        for label, judged in zoo.judges([m.report for m in matched], around=bool(neighbours)):
            matched_lines.append(f"* {label}: {judged.verdict()}")
            if label != "the input alone":
                worst = judged.worst()
                matched_lines.append(
                    f"  * worst {worst.name}: HTP {worst.htp.rel_l2:.3g} / cosine "
                    f"{worst.htp.cosine:.6f}, torch fp16 {worst.floor.rel_l2:.3g} / "
                    f"{worst.floor.cosine:.6f}"
                )
    within = "yes" if report.within else "no"
    offending = "; ".join(report.offending) or "-"
    alone = sum(r.within for r in reports)
    if neighbours:
        (_, median), (_, first) = judges[1:]
        own = "yes" if first.within else f"no, {len(first.offending)} outside"
        typical = "yes" if median.within else f"no, {len(median.offending)} outside"
        within += (
            f" (pooled over the input and {neighbours - 1} neighbours; {alone} within alone; "
            f"medians: {typical}; the input alone: {own})"
        )
        offending = (
            f"pooled: {offending}; medians: {'; '.join(median.offending) or '-'}; "
            f"the input alone: {'; '.join(first.offending) or '-'}"
        )
    elif inputs > 1:
        within += f" (pooled over {inputs} inputs; {alone} within alone)"
    rows = compiled.report.rows
    worst = report.worst()
    row = (
        f"| {arch} | {scheme} | {size} | {soc} | {harness.delegate_count(compiled.edge)} "
        f"| {', '.join(cpu_ops(compiled.edge)) or 'nothing'} "
        f"| {compiled.report.delegated} of {len(rows)} | {len(report.rows)} "
        f"| {within} "
        f"| {offending} "
        f"| {worst.name} {worst.htp.rel_l2:.3g} (floor {worst.floor.rel_l2:.3g}) "
        f"| {export_s:.0f} + {compiled.lower_seconds:.0f} + {run_s:.0f} |"
    )
    if spread:
        spreads = fidelity.input_spread(graph.model, graph.inputs, graph.program, spread)
        ill = set(report.ill_conditioned(spreads))
        outside = [r.name for r in report.rows if not r.within]
        row += (
            f" {len(ill)} ({len([n for n in outside if n in ill])} of the {len(outside)} outside) |"
        )
    return row, report, judges, matched_lines


def why(arch: str, scheme: str, size: int, judges: list[tuple[str, fidelity.Report]]) -> list[str]:
    """Markdown lines: each judge's tensors outside the bound and the kink flips behind them."""
    summaries, flips, explained = zoo.causes(arch, scheme, size, judges)
    if not explained:
        return []
    lines = [
        f"**{arch} {scheme} {size} px**: {sum(s.near for s in summaries)} gate elements near a "
        f"kink, {sum(s.flipped_fp16 for s in summaries)} flipped by torch fp16, {len(flips)} "
        "flips computed (on the graph's input)",
        "",
    ]
    for label, causes in explained:
        count = sum(c.explained for c in causes)
        lines.append(f"* {label}: {count} of {len(causes)} outside explained by one flip")
        lines += [f"  * {c.describe()}" for c in causes]
    return [*lines, ""]


def measure_cpu(arch: str, scheme: str, size: int) -> tuple[str, bool]:
    """The all-CPU program (no QNN: what runs where nothing is delegated) against fp32 torch.

    ``MaxPoolBackwardOnCpu`` works around executorch 1.5.1's max-pool backward kernel.
    """
    from executorch.exir import to_edge

    from qnn_convbwd import integration
    from qnn_convbwd.passes.max_pool_backward import MaxPoolBackwardOnCpu

    graph = zoo.graph(arch, scheme, size)
    edge = to_edge(graph.program, compile_config=integration.get("qnn_edge_config")())
    pte = edge.transform([MaxPoolBackwardOnCpu()]).to_executorch().buffer
    outputs = zoo.joint_outputs(graph, harness.run_pte(pte, list(graph.inputs)))
    names = fidelity.output_names(graph.program)
    worst_name, worst = "", 0.0
    for name, got, want in zip(names, outputs, graph.reference()):
        rel = fidelity.Metrics.of(got, want).rel_l2
        if rel > worst:
            worst_name, worst = name, rel
    ok = worst <= CPU_REL_L2
    return (
        f"| {arch} | {scheme} | {size} | CPU only | {worst_name} {worst:.2g} "
        f"| {'yes' if ok else 'no'} |",
        ok,
    )


# fp32 kernels against fp32 eager autograd: only summation order differs.
CPU_REL_L2 = 1e-4


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("arch", nargs="*", default=list(zoo.ARCHITECTURES))
    parser.add_argument("--soc", nargs="+", default=["SM8650"])
    parser.add_argument("--scheme", nargs="+", default=["bias_only"], choices=zoo.SCHEMES)
    parser.add_argument("--size", nargs="+", type=int, default=[32])
    parser.add_argument("--tensors", action="store_true", help="per-tensor report too")
    parser.add_argument(
        "--inputs", type=int, default=1, help="judge errors pooled over this many inputs"
    )
    parser.add_argument(
        "--neighbours",
        type=int,
        default=0,
        metavar="K",
        help="judge errors pooled over the input and K - 1 copies moved by one fp16 rounding "
        "(fidelity.neighbours); the input's own verdict is printed too",
    )
    parser.add_argument(
        "--dump",
        metavar="PATH",
        help="write each input's rel L2 and cosine (HTP, floor) per tensor as JSON; "
        "{arch}, {scheme}, {size}, {soc} are filled in",
    )
    parser.add_argument(
        "--spread",
        type=int,
        default=0,
        metavar="DRAWS",
        help="also count the ill-conditioned tensors (fidelity.input_spread, DRAWS draws)",
    )
    parser.add_argument(
        "--why",
        action="store_true",
        help="after the table, the gate flips (qnn_convbwd_dev.kinks) behind every tensor outside",
    )
    parser.add_argument(
        "--gates",
        action="store_true",
        help="also judge each graph with each side's own gate decisions (zoo.gate_matched; "
        "lowers it a second time)",
    )
    parser.add_argument(
        "--cpu", action="store_true", help="check the all-CPU programs against fp32 torch instead"
    )
    parser.add_argument(
        "--set", nargs="*", default=[], metavar="OPTION=VALUE", help="qnn_convbwd options"
    )
    args = parser.parse_args()
    with qnn_convbwd.enabled(**zoo.parse_options(args.set)):
        return sweep(args)


def sweep(args: argparse.Namespace) -> int:
    ok = True
    if args.cpu:
        print(
            "| model | scheme | px | program | worst rel L2 vs fp32 | right |\n"
            "|---|---|---|---|---|---|"
        )
        for arch, scheme, size in itertools.product(args.arch, args.scheme, args.size):
            row, right = measure_cpu(arch, scheme, size)
            print(row, flush=True)
            ok &= right
        return 0 if ok else 1
    extra = " ill-conditioned |" if args.spread else ""
    print(
        "| model | scheme | px | SoC | delegates | on CPU | convolution_backward delegated "
        f"| outputs | within | offending | worst rel L2 | export + lower + run s |{extra}\n"
        "|" + "---|" * 12 + ("---|" if extra else "")
    )
    causes: list[str] = []
    gated: list[str] = []
    for arch, scheme, size, soc in itertools.product(args.arch, args.scheme, args.size, args.soc):
        try:
            row, report, judges, matched = measure(
                arch,
                scheme,
                soc,
                size,
                args.inputs,
                args.spread,
                args.neighbours,
                args.dump,
                args.gates,
            )
        except Exception as err:  # one graph's failure must not hide the others
            print(
                f"| {arch} | {scheme} | {size} | {soc} | failed: "
                f"{type(err).__name__}: {str(err)[:300]} |",
                flush=True,
            )
            ok = False
            continue
        print(row, flush=True)
        if args.tensors:
            print(report.to_markdown(), flush=True)
        ok &= report.within
        if args.why:
            causes += why(arch, scheme, size, judges)
        gated += matched
    if causes:
        print("\n### Why outside\n", *causes, sep="\n", flush=True)
    if gated:
        print("\n### On each side's own gates\n", *gated, sep="\n", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
