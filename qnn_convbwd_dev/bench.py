"""``qnn-convbwd bench``: training graphs lowered with and without the plugin.

Every reference graph (``qnn_convbwd_dev.models``) is lowered three ways in one run:

``plugin``
    ``qnn_convbwd.lower`` (the plugin enabled).
``kept_on_cpu``
    The plugin enabled, but every ``aten.convolution_backward.default`` excluded
    through QnnPartitioner's ``skip_node_op_set``: the rest lowers, the
    convolution_backward nodes stay on CPU.
``plain``
    executorch 1.5.1's own Qualcomm flow with the plugin disabled (the steps of
    ``to_edge_transform_and_lower_to_qnn``, starting from the joint program).

For each it records delegate partitions, call_function nodes left on CPU,
convolution_backward nodes left on CPU, static tensor bytes in the QNN graph
(when ``qnn_convbwd.toolchain.saver`` is available), context-binary bytes, AOT
lowering seconds (median of ``--repeats``), and the program's run on the x86-64
HTP simulator against eager autograd: the maximum absolute error and the
fidelity verdict (``qnn_convbwd_dev.fidelity``: per tensor against torch's own fp16 step,
the floor). A lowering or run
that fails is recorded with its error, never hidden.

The scaling study lowers the same backbone at depth x1, x2, x4 in a fresh
subprocess per point (so peak RSS is per point) and reports growth factors.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

# The bench is built from its parts; their names stay reachable as ``bench.<name>``.
from .bench_charts import (
    draw_chart,
    draw_charts,
    draw_scaling_chart,
)
from .bench_lowering import (
    CONV_BWD,
    GraphResult,
    GraphSpec,
    ModeResult,
    count_conv_bwd,
    error_text,
    graph_counts,
    lower_plain,
    lower_with_plugin,
)
from .bench_modes import MODE_LABELS, MODES, SCALING_MODES
from .bench_report import (
    environment,
    markdown_table,
    scaling_growth_line,
    scaling_table,
)
from .bench_running import (
    Simulator,
    child_failure,
    measure_graph,
    measure_point,
    run_point_subprocess,
    scaling,
    scaling_summary,
)

logger = logging.getLogger(__name__)

__all__ = [
    "CONV_BWD",
    "GraphResult",
    "GraphSpec",
    "MODES",
    "MODE_LABELS",
    "ModeResult",
    "SCALING_MODES",
    "Simulator",
    "add_arguments",
    "child_failure",
    "count_conv_bwd",
    "draw_chart",
    "draw_charts",
    "draw_scaling_chart",
    "environment",
    "error_text",
    "graph_counts",
    "lower_plain",
    "lower_with_plugin",
    "markdown_table",
    "measure_graph",
    "measure_point",
    "run",
    "run_point_subprocess",
    "scaling",
    "scaling_growth_line",
    "scaling_summary",
    "scaling_table",
]

DEFAULT_OUT = Path("docs") / "bench"


# --- CLI -------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--soc", default="SM8650", help="target SoC (default SM8650)")
    parser.add_argument("--backbones", nargs="+", default=["resnet", "mobilenet"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[16, 32], help="input H=W")
    parser.add_argument(
        "--kinds",
        nargs="+",
        choices=["frozen", "trainable"],
        default=["frozen", "trainable"],
        help="frozen backbone + trainable adapter, and/or fully trainable",
    )
    parser.add_argument("--depth", type=int, default=1, help="stage count of the backbones")
    parser.add_argument("--channels", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="lowerings per median (>= 1)")
    parser.add_argument("--no-simulate", action="store_true", help="skip the simulator runs")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--no-scaling", action="store_true", help="skip the scaling study")
    parser.add_argument("--scaling-only", action="store_true", help="only the scaling study")
    parser.add_argument("--scaling-backbone", default="resnet")
    parser.add_argument("--scaling-depths", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--scaling-size", type=int, default=32)
    parser.add_argument("--scaling-repeats", type=int, default=3)


def _executorch_warnings_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING or not record.name.startswith("executorch")


def run(args: argparse.Namespace) -> int:
    if not getattr(args, "verbose", False):
        # executorch's loggers set their own INFO level; keep that chatter out of the report.
        for handler in logging.getLogger().handlers:
            handler.addFilter(_executorch_warnings_only)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    wall = time.perf_counter()
    report: dict[str, Any] = {"environment": environment(args.soc)}
    md: list[str] = []

    if not args.scaling_only:
        specs = [
            GraphSpec(b, s, kind == "trainable", args.depth, args.channels)
            for b in args.backbones
            for s in args.sizes
            for kind in args.kinds
        ]
        results = []
        with Simulator() as simulator:
            for spec in specs:
                start = time.perf_counter()
                results.append(
                    measure_graph(
                        spec,
                        args.soc,
                        args.repeats,
                        simulator=None if args.no_simulate else simulator,
                    )
                )
                seconds = time.perf_counter() - start
                print(f"measured {spec.name} in {seconds:.0f} s", file=sys.stderr, flush=True)
        report["graphs"] = [r.to_json() for r in results]
        table = markdown_table(results)
        about = (
            f"Lowering seconds are medians of {args.repeats} lowerings (wall clock, and CPU "
            "time of the process); max abs err is the x86-64 HTP simulator against eager "
            "autograd over the outputs the graph signature declares; fidelity judges each of "
            "those tensors against fp32 autograd next to torch's own fp16 step (within: "
            "relative L2 at most 2x the fp16 step's + 1e-3 and the cosine limit, "
            "docs/numerics.md), the worst tensor's relative L2 then the fp16 step's. Static "
            "bytes come from a Saver recording of the first QNN partition."
        )
        md += [f"## Training graphs on {args.soc}\n", about, "", table, "", "![chart](bench.png)"]
        md.append("")
        print(table, flush=True)

    if not args.no_scaling:
        scale = scaling(
            args.scaling_backbone,
            args.scaling_depths,
            args.scaling_size,
            args.soc,
            args.scaling_repeats,
            args.channels,
        )
        report["scaling"] = scale
        table = scaling_table(scale["summary"])
        title = (
            f"## Scaling: {args.scaling_backbone} {args.scaling_size}px frozen, "
            f"depth {' / '.join(f'x{d}' for d in args.scaling_depths)}\n"
        )
        growth = scaling_growth_line(scale["summary"])
        md += [title, table, "", growth, "", "![scaling](scaling.png)", ""]
        print()
        print(table)
        print(growth)
        errors = [p for p in scale["points"] if "error" in p]
        for p in errors:
            print(f"scaling point depth x{p['depth']} {p['mode']}: {p['error']}")

    report["wall_seconds"] = time.perf_counter() - wall
    env = report["environment"]
    md.insert(
        0,
        f"# qnn-convbwd bench\n\n{env['date']}, executorch {env['executorch']}, torch "
        f"{env['torch']}, QAIRT {env['qairt']} ({env['sdk_source']}), {env['cpus']} CPUs, "
        f"git {env['git']}{' + uncommitted changes' if env['git_modified_py'] else ''}, "
        f"wall {report['wall_seconds']:.0f} s\n",
    )
    (out / "bench.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "bench.md").write_text("\n".join(md) + "\n")
    charts = draw_charts(out / "bench.json", out)
    print(f"\nwrote {out / 'bench.json'}, {out / 'bench.md'}, " + ", ".join(map(str, charts)))
    print(f"wall {report['wall_seconds']:.0f} s")
    return 0


def _child_main(argv: list[str]) -> int:
    """Child processes of the bench (a crash there must not end the bench).

    ``python -m qnn_convbwd_dev.bench point POINT_JSON OUT_JSON``: one scaling point
    (the charts' child is ``bench_charts``).
    """
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("executorch").setLevel(logging.WARNING)
    if argv[0] == "point":
        point, out = json.loads(argv[1]), Path(argv[2])
        out.write_text(json.dumps(measure_point(point)))
        return 0
    raise SystemExit(f"unknown child command {argv[0]!r}")


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
