"""The bench's charts, drawn from a bench.json in a child process
(``python -m qnn_convbwd_dev.bench_charts REPORT_JSON OUT_DIR``): matplotlib's
FreeType extension crashes on import once the QNN system libraries are loaded
globally into the process, and this module imports neither torch nor executorch."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .bench_modes import MODE_LABELS, MODES, SCALING_MODES

logger = logging.getLogger(__name__)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw_chart(graphs: Sequence[dict], path: Path) -> None:
    """Partitions and CPU-resident ops per graph (``GraphResult.to_json`` dicts)."""
    plt = _pyplot()
    names = [g["graph"].replace(" ", "\n", 1) for g in graphs]
    x = list(range(len(graphs)))
    width = 0.27
    colours = {"plugin": "#1f77b4", "kept_on_cpu": "#ff7f0e", "plain": "#7f7f7f"}
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.4 * len(graphs) + 2), 8), sharex=True)
    panels = (("partitions", "delegate partitions"), ("cpu_ops", "ops left on CPU"))
    for ax, (field, title) in zip(axes, panels):
        top = 1
        for i, mode in enumerate(MODES):
            modes = [g["modes"].get(mode, {}) for g in graphs]
            values = [m.get(field) for m in modes]
            xs = [xi + (i - 1) * width for xi in x]
            label = MODE_LABELS[mode]
            if any(m.get("error") for m in modes):
                label += " (red: lowering fails)"
            bars = ax.bar(xs, [v or 0 for v in values], width, label=label, color=colours[mode])
            for bar, v, m in zip(bars, values, modes):
                failed = v is None and m.get("error")
                ax.annotate(
                    "fails" if failed else ("n/a" if v is None else str(v)),
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                    color="#d62728" if failed else "black",
                )
            top = max(top, *[v or 0 for v in values])
        ax.set_ylim(0, top * 1.25 + 0.8)
        ax.set_ylabel(title)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(loc="upper left", fontsize=8)
    axes[-1].set_xticks(x)
    axes[-1].set_xticklabels(names, fontsize=8)
    fig.suptitle("Joint forward-backward graphs on QNN HTP: with vs without the plugin")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_scaling_chart(scale: dict, path: Path) -> None:
    """Lowering time (wall and CPU) and peak RSS increase against the depth multiplier."""
    plt = _pyplot()
    points = [p for p in scale["points"] if "error" not in p]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    colours = {"plugin": "#1f77b4", "kept_on_cpu": "#ff7f0e"}
    for mode in SCALING_MODES:
        mine = sorted((p for p in points if p["mode"] == mode), key=lambda p: p["depth"])
        depths = [p["depth"] for p in mine]
        label, colour = MODE_LABELS[mode], colours[mode]
        left.plot(
            depths,
            [p["median_process_seconds"] for p in mine],
            "o-",
            color=colour,
            label=f"{label} (CPU time)",
        )
        left.plot(
            depths,
            [p["median_seconds"] for p in mine],
            "o--",
            color=colour,
            alpha=0.5,
            label=f"{label} (wall)",
        )
        mib = [p["peak_delta_kib"] / 1024 for p in mine]
        right.plot(depths, mib, "o-", color=colour, label=label)
    titles = ((left, "AOT lowering seconds (median)"), (right, "peak RSS increase (MiB)"))
    for ax, title in titles:
        ax.set_xlabel("depth multiplier")
        ax.set_title(title)
        ax.set_xticks(sorted({p["depth"] for p in points}))
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_charts(report_path: Path, out: Path) -> list[Path]:
    """Draw the charts of a bench.json in a child process.

    matplotlib's FreeType extension crashes on import once the QNN system
    libraries are loaded globally into the process, so the bench never imports it.
    """
    from .bench_running import child_failure

    cmd = [sys.executable, "-m", "qnn_convbwd_dev.bench_charts", str(report_path), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"drawing the charts failed: {child_failure(proc)}")
    return [Path(line) for line in proc.stdout.split()]


def _draw_from_report(report_path: Path, out: Path) -> list[Path]:
    report = json.loads(report_path.read_text())
    drawn = []
    if report.get("graphs"):
        draw_chart(report["graphs"], out / "bench.png")
        drawn.append(out / "bench.png")
    if report.get("scaling"):
        draw_scaling_chart(report["scaling"], out / "scaling.png")
        drawn.append(out / "scaling.png")
    return drawn


if __name__ == "__main__":
    for drawn in _draw_from_report(Path(sys.argv[1]), Path(sys.argv[2])):
        print(drawn)
