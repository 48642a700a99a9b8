#!/usr/bin/env python3
"""Cost of torchvision models' training steps: MACs, stored weight bytes, memory, time.

For one architecture, scheme, input size and SoC (``tests/zoo.graph``), three
lowerings of the joint graph:

* the plugin (``qnn_convbwd.lower``), QNN graphs captured: multiply-adds of the
  lowered program against the ideal step (``qnn_convbwd_dev.cost``), context bytes,
  executorch's planned memory, delegates, wall time;
* every backward kept on CPU (``cost.BACKWARD_ON_CPU``): planned memory,
  delegates, time (``--no-cpu-baseline`` skips it);
* the plugin with QNN's Saver backend, in a child process
  (``toolchain.saver.record``; first partition only): the static tensors QNN
  receives, with their data, attributed to the frozen weights by value
  (``cost.weight_copies``): the per-weight bytes of the 0.05 rule. Skipped
  when no convolution weight is frozen (scheme ``full``).

Prints one markdown row of the cost table (``docs/cost.md``) and, with
``--json FILE``, writes the details (every frozen weight's tensors) as one
line, in place of that row's line if the file has one (one line per model,
scheme, px and SoC); ``--table FILE`` prints the whole table from such a file
(``--columns saver`` or ``htp``: the Saver recording's columns, or the HTP
compilation's).

    PYTHONPATH=. python scripts/zoo_cost.py resnet18 adapter --soc SM8650 --size 32 \\
        --json cost.jsonl
    PYTHONPATH=. python scripts/zoo_cost.py --table cost.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from qnn_convbwd.toolchain import saver
from qnn_convbwd_dev import cost, zoo

KEY = ("model", "scheme", "px", "SoC")
# the columns of the Saver recording (or, where there is one, the HTP lowering's MACs) ...
SAVER = (
    "MACs lowered / ideal",
    "frozen conv weights >= 64 KiB",
    "static tensors, readers of each",
    "worst extra static B / size (weight)",
    "<= 0.05",
)
# ... and those only an HTP compilation measures (``--no-htp`` leaves them out)
HTP = (
    "context B: plugin / backward on CPU",
    "context beyond its static data B (/ data)",
    "planned memory B: plugin / backward on CPU",
    "delegates: plugin / CPU",
    "convolution_backward delegated",
)
TIME = "lowering s: plugin / CPU / Saver"
COLUMNS = {
    "all": (*KEY, *SAVER, *HTP, TIME),
    "saver": (*KEY, *SAVER, "Saver s"),
    "htp": (*KEY, *HTP, "lowering s: plugin / CPU"),
}
HEADER = "| " + " | ".join(COLUMNS["all"]) + " |"


SCHEME_ORDER = ("adapter", "bias_only", "last_layers", "full")


def separator(header: str) -> str:
    return "|" + "---|" * (header.count(" | ") + 1)


def measure(
    arch: str,
    scheme: str,
    soc: str,
    size: int,
    cpu_baseline: bool,
    keep: Path | None = None,
    htp: bool = True,
) -> dict:
    """One row; ``htp=False``: the Saver recording only (no HTP compilation, no CPU baseline)."""
    start = time.perf_counter()
    graph = zoo.graph(arch, scheme, size)
    export_s = time.perf_counter() - start
    ideal = cost.ideal_macs(graph.model, graph.inputs)
    plugin = cost.measure_program(graph.program, graph.model, soc, "plugin") if htp else None
    on_cpu = None
    if cpu_baseline and htp:
        on_cpu = cost.measure_program(
            graph.program, graph.model, soc, "backward on CPU", set(cost.BACKWARD_ON_CPU)
        )
    saved = saver_part(graph, soc, keep, always=not htp)
    return {
        "arch": arch,
        "scheme": scheme,
        "size": size,
        "soc": soc,
        "export_s": export_s,
        "ideal": {p: sum(getattr(layer, p) for layer in ideal) for p in cost.PHASES},
        "plugin": lowered_dict(plugin) if plugin else None,
        "on_cpu": lowered_dict(on_cpu) if on_cpu else None,
        "saver": saved,
    }


def saver_part(graph, soc: str, keep: Path | None = None, always: bool = False) -> dict | None:
    """The Saver recording's static tensors by frozen conv weight and its MACs.

    None when no convolution weight is frozen, unless ``always``.
    """
    if not always and not any(
        not p.requires_grad and p.dim() >= 3 for p in graph.model.parameters()
    ):
        return None
    recorded = saver.record(graph.program, soc, keep=keep)
    by_value = cost.weight_copies(graph.model, recorded)
    return {
        "qnn_macs": cost.saver_op_macs(recorded),
        "seconds": recorded.seconds,
        "ops": len(recorded.ops),
        "static_bytes": by_value.static_bytes,
        "unattributed": by_value.unattributed,
        "weights": [
            {
                "parameter": w.parameter,
                "shape": w.shape,
                "size": w.size,
                "static": w.static,
                "ratio": w.ratio,
                "coverage": w.coverage,
                "readers": w.readers,
                "large": w.large,
                "tensors": w.tensors,
            }
            for w in by_value.weights
        ],
    }


def lowered_dict(low: cost.Lowered) -> dict:
    return {
        "qnn_macs": low.qnn_macs,
        "cpu_macs": low.cpu_macs,
        "total_macs": low.total_macs,
        "context": low.context,
        "static_bytes": low.static_bytes,
        "planned": low.planned,
        "pte": low.pte,
        "delegates": low.delegates,
        "backward_delegated": low.backward_delegated,
        "on_cpu": low.on_cpu,
        "seconds": low.seconds,
    }


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def cells(result: dict) -> dict[str, str]:
    """One row of the cost table, by column (``COLUMNS``)."""
    ideal = sum(result["ideal"].values())
    on_cpu = result["on_cpu"]
    rec = result["saver"] or {"weights": [], "seconds": None}  # None: no frozen conv weight
    plugin = result["plugin"]
    if plugin is None:  # the Saver recording only: its MACs (the delegated partition)
        plugin = {"total_macs": sum(rec["qnn_macs"].values()), "seconds": None}
    large = [w for w in rec["weights"] if w["large"]]
    worst = max(large, key=lambda w: w["ratio"], default=None)
    worst_text = "-"
    if worst:
        same = all(w["ratio"] == worst["ratio"] for w in large)
        which = "each" if same and len(large) > 1 else worst["parameter"].removeprefix("net.")
        worst_text = f"{worst['ratio']:.3f} ({which})"
    shared = [w for w in large if w.get("readers", 1) > 1]
    meets = "yes" if (worst is None or worst["ratio"] <= 0.05) and not shared else "**no**"
    if shared:  # the HTP prepares a static tensor once per reading op (docs/weight_bytes.md)
        meets += f"; {len(shared)} read by more than one op"
    lost = [w["parameter"].removeprefix("net.") for w in large if w["coverage"] < 1]
    if lost:  # a weight no static tensor holds whole: its values were changed on the way
        meets += f"; not found whole by value: {', '.join(lost)}"
    if plugin.get("delegates", 1) > 1:
        meets += f" (first of {plugin['delegates']} partitions only)"
    counts = sorted({(len(w["tensors"]), w.get("readers", "?")) for w in large}, key=str)
    stored = ", ".join(f"{n} ({r})" for n, r in counts) or "-"
    cpu = on_cpu or {}
    # the HTP stores the fp32-declared static tensors in fp16 (use_fp16)
    beyond = "-"
    if "context" in plugin:
        data = plugin["static_bytes"] // 2
        beyond = f"{plugin['context'] - data:,} ({(plugin['context'] - data) / data:.3f})"

    def pair(name: str) -> str:
        mine = f"{plugin[name]:,}" if name in plugin else "-"
        return f"{mine} / " + (f"{cpu[name]:,}" if name in cpu else "-")

    lowering = f"{seconds(plugin['seconds'])} / {seconds(cpu.get('seconds'))}"
    return dict(
        zip(
            (*KEY, *SAVER, *HTP),
            (
                result["arch"],
                result["scheme"],
                str(result["size"]),
                result["soc"],
                f"**{plugin['total_macs'] / ideal:.3f}** ({plugin['total_macs']:,} / {ideal:,})",
                str(len(large)),
                stored,
                worst_text,
                meets,
                pair("context"),
                beyond,
                pair("planned"),
                pair("delegates"),
                str(plugin.get("backward_delegated", "-")),
            ),
        ),
        **{
            TIME: f"{lowering} / {seconds(rec['seconds'])}",
            "Saver s": seconds(rec["seconds"]),
            "lowering s: plugin / CPU": lowering,
        },
    )


def row(result: dict, columns: str = "all") -> str:
    by_column = cells(result)
    return "| " + " | ".join(by_column[c] for c in COLUMNS[columns]) + " |"


def key(result: dict) -> tuple:
    return result["arch"], result["scheme"], result["size"], result["soc"]


def write(path: Path, result: dict) -> None:
    """Put ``result`` in ``path``: in place of the line of the same row, else appended."""
    line = json.dumps(result)
    out, placed = [], False
    for old in path.read_text().splitlines() if path.exists() else []:
        if key(json.loads(old)) != key(result):
            out.append(old)
        elif not placed:
            out.append(line)
            placed = True
    if not placed:
        out.append(line)
    path.write_text("".join(f"{text}\n" for text in out))


def table(path: Path, columns: str = "all") -> str:
    """The cost table of every result in ``path``, one line per row (model, scheme, px, SoC).

    ``columns="htp"`` keeps the rows an HTP compilation measured (plugin or CPU).
    """
    results: dict[tuple, dict] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        result = json.loads(line)
        if key(result) in results:
            raise ValueError(f"{path}:{number}: a second line for {key(result)}")
        results[key(result)] = result
    if columns == "htp":
        results = {k: r for k, r in results.items() if r["plugin"] or r["on_cpu"]}
    order = sorted(results, key=lambda k: (k[0], k[3], k[2], SCHEME_ORDER.index(k[1])))
    header = "| " + " | ".join(COLUMNS[columns]) + " |"
    return "\n".join([header, separator(header), *(row(results[k], columns) for k in order)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("arch", nargs="?", choices=zoo.ARCHITECTURES)
    parser.add_argument("scheme", nargs="?", choices=zoo.SCHEMES)
    parser.add_argument("--soc", default="SM8650")
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--no-cpu-baseline", dest="cpu_baseline", action="store_false")
    parser.add_argument("--json", type=Path, help="append the details to this file")
    parser.add_argument("--header", action="store_true", help="print the table header first")
    parser.add_argument("--keep", type=Path, help="copy the Saver recording to this directory")
    parser.add_argument(
        "--saver-only",
        action="store_true",
        help="redo only the Saver part of this row's result in the --json file",
    )
    parser.add_argument(
        "--cpu-only",
        action="store_true",
        help="redo only the backward-on-CPU part of this row's result in the --json file",
    )
    parser.add_argument(
        "--no-htp",
        dest="htp",
        action="store_false",
        help="the Saver recording only: MACs and weight bytes, no HTP compilation",
    )
    parser.add_argument("--table", type=Path, help="print the table of a --json file and exit")
    parser.add_argument(
        "--columns",
        choices=COLUMNS,
        default="all",
        help="--table: every column, the Saver recording's, or the HTP compilation's",
    )
    args = parser.parse_args(argv)
    if args.table:
        print(table(args.table, args.columns))
        return 0
    if not (args.arch and args.scheme):
        parser.error("arch and scheme are required (or --table FILE)")
    if args.saver_only or args.cpu_only:  # redo one part of this row's result in --json
        wanted = (args.arch, args.scheme, args.size, args.soc)
        lines = args.json.read_text().splitlines()
        result = next(r for r in map(json.loads, lines) if key(r) == wanted)
        graph = zoo.graph(args.arch, args.scheme, args.size)
        if args.saver_only:
            result["saver"] = saver_part(graph, args.soc, args.keep)
        if args.cpu_only:
            on_cpu = cost.measure_program(
                graph.program, graph.model, args.soc, "backward on CPU", set(cost.BACKWARD_ON_CPU)
            )
            result["on_cpu"] = lowered_dict(on_cpu)
    else:
        result = measure(
            args.arch, args.scheme, args.soc, args.size, args.cpu_baseline, args.keep, args.htp
        )
    if args.json:
        write(args.json, result)
    if args.header:
        print(HEADER + "\n" + separator(HEADER))
    print(row(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
