"""The bench's report: its modes and their labels, the markdown tables, the
environment it ran in."""

from __future__ import annotations

import datetime
import logging
import os
import platform
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .bench_lowering import GraphResult, ModeResult

from .bench_modes import MODE_LABELS, SCALING_MODES

logger = logging.getLogger(__name__)


# --- rendering -------------------------------------------------------------------------


def _fmt(value: Any, spec: str = "") -> str:
    if value is None:
        return "n/a"
    return format(value, spec)


def _bytes_cell(value: int | None, note: str = "") -> str:
    if value is None:
        return "n/a"
    return f"{value:,} ({note})" if note and not note.startswith("n/a") else f"{value:,}"


def _conv_bwd_cell(m: ModeResult, exported: int) -> str:
    """``on CPU of total after lowering``, and the exported count when the lowering split nodes."""
    total = m.conv_bwd_on_cpu + (m.conv_bwd_delegated or 0)
    split = f" ({exported} exported)" if total != exported else ""
    return f"{m.conv_bwd_on_cpu} of {total}{split}"


def _error_cell(m: ModeResult) -> str:
    if m.run_error:
        return "run failed"
    return _fmt(m.max_abs_error, ".1e")


def _fidelity_cell(m: ModeResult) -> str:
    """``within`` or ``N of M outside``, then the worst tensor: rel L2 (torch fp16's)."""
    if m.fidelity_outside is None:
        return "n/a"
    verdict = f"{m.fidelity_outside} of {m.fidelity_tensors} outside"
    if m.fidelity_outside == 0:
        verdict = "within"
    return f"{verdict}; worst {m.fidelity_worst}"


def markdown_table(results: Sequence[GraphResult]) -> str:
    head = (
        "| graph | lowering | partitions | CPU ops | conv_bwd on CPU | static bytes "
        "(joint / fwd-only) | context bytes (joint / fwd-only) | lower s wall / CPU "
        "| max abs err | fidelity (rel L2, fp16 floor) | note |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in results:
        for mode, m in r.modes.items():
            label = MODE_LABELS[mode]
            fwd_static = _bytes_cell(r.forward_static_bytes)
            fwd_ctx = _bytes_cell(r.forward_context_binary_bytes)
            if m.error:
                lines.append(
                    f"| {r.spec.name} | {label} | — | — | — | — | — | — | — | — | "
                    f"lowering fails: `{m.error}` |"
                )
                continue
            notes = []
            if m.run_error:
                notes.append(f"simulator: `{m.run_error}`")
            if m.static_bytes is None and m.static_bytes_note:
                notes.append(f"static bytes {m.static_bytes_note}")
            if m.extra_outputs:
                notes.append(f"{m.extra_outputs} output(s) beyond the signature")
            note = "; ".join(notes)
            lines.append(
                f"| {r.spec.name} | {label} | {m.partitions} | {m.cpu_ops} | "
                f"{_conv_bwd_cell(m, r.conv_bwd_nodes)} | "
                f"{_bytes_cell(m.static_bytes, m.static_bytes_note)} / {fwd_static} | "
                f"{_bytes_cell(m.context_binary_bytes)} / {fwd_ctx} | "
                f"{_fmt(m.median_seconds, '.2f')} / {_fmt(m.median_process_seconds, '.2f')} | "
                f"{_error_cell(m)} | {_fidelity_cell(m)} | {note} |"
            )
    return "\n".join(lines)


def scaling_table(summary: Sequence[dict], modes: Sequence[str] = SCALING_MODES) -> str:
    """Seconds are medians; "x" columns are growth over the first depth.

    Graph nodes grow about linearly with depth, weight bytes faster (channels
    double per stage); memory is expected to follow the weights.
    """
    short = {"plugin": "plugin", "kept_on_cpu": "kept"}
    head = ["depth", "x nodes", "x weights"]
    for mode in modes:
        m = short.get(mode, mode)
        head += [f"{m} wall s", f"{m} CPU s", f"{m} x CPU s", f"{m} peak MiB", f"{m} x MiB"]
    head += ["plugin/kept wall s", "plugin/kept CPU s", "plugin/kept MiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in summary:
        size = next((row[m] for m in modes if row.get(m)), {})
        cells = [f"x{row['depth']}"]
        cells += [_fmt(size.get(k), ".2f") for k in ("node_growth", "parameter_growth")]
        for mode in modes:
            m = row.get(mode)
            if m is None:
                cells += ["error"] * 5
                continue
            cells += [
                f"{m['median_seconds']:.2f}",
                f"{m['median_process_seconds']:.2f}",
                f"{m['process_time_growth']:.2f}",
                f"{m['peak_delta_mib']:.1f}",
                _fmt(m["memory_growth"], ".2f"),
            ]
        cells += [_fmt(row.get(k), ".2f") for k in ("time_ratio", "process_time_ratio")]
        cells.append(_fmt(row.get("memory_ratio"), ".2f"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def scaling_growth_line(summary: Sequence[dict]) -> str:
    """First depth to last: growth of graph size, time and memory; plugin/kept ratio drift."""
    first, last = summary[0], summary[-1]
    if not all(row.get(m) for row in (first, last) for m in SCALING_MODES):
        return "growth: n/a (a scaling point failed)"
    p, k = last["plugin"], last["kept_on_cpu"]
    return (
        f"x{first['depth']} -> x{last['depth']}: joint graph nodes {p['node_growth']:.2f}x, "
        f"weight bytes {p['parameter_growth']:.2f}x; "
        f"lowering CPU time plugin {p['process_time_growth']:.2f}x, kept on CPU "
        f"{k['process_time_growth']:.2f}x; peak RSS increase plugin "
        f"{_fmt(p['memory_growth'], '.2f')}x, kept on CPU {_fmt(k['memory_growth'], '.2f')}x; "
        f"CPU time plugin/kept {first['process_time_ratio']:.2f} -> "
        f"{last['process_time_ratio']:.2f}"
    )


def environment(soc: str) -> dict:
    import importlib.util

    from qnn_convbwd import integration
    from qnn_convbwd.toolchain import SdkUnavailable, ensure_sdk

    try:
        sdk = ensure_sdk()
    except SdkUnavailable:
        sdk = None

    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent
            ).stdout.strip()
        except OSError:
            return ""

    # Files that differ from the commit (the measured code is the working tree).
    changed = [
        line[3:]
        for line in git("status", "--porcelain", "--untracked-files=no").splitlines()
        if line[3:].endswith(".py")
    ]
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "soc": soc,
        "executorch": integration.executorch_version(),
        "torch": torch.__version__,
        "qairt": sdk.build_id if sdk else None,
        "sdk_source": sdk.source if sdk else None,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "git": git("rev-parse", "--short", "HEAD"),
        "git_modified_py": changed,
        "saver": importlib.util.find_spec("qnn_convbwd.toolchain.saver") is not None,
    }
