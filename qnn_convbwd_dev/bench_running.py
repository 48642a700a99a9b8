"""The bench's runs: the program on the x86-64 HTP simulator in a worker process
(a crash there is an error, not the end of the bench), one graph measured, and the
scaling study (one subprocess per point)."""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .bench_lowering import (
    CONV_BWD,
    GraphResult,
    GraphSpec,
    ModeResult,
    _lowerer,
    count_conv_bwd,
    error_text,
    graph_counts,
    lower_with_plugin,
    static_bytes,
    timed_lowerings,
)
from .bench_modes import MODE_LABELS, MODES, SCALING_MODES

logger = logging.getLogger(__name__)

# --- one graph -----------------------------------------------------------------------


def compare(outputs: Sequence[torch.Tensor], reference: Sequence[torch.Tensor]) -> float:
    """Max absolute error of the outputs the signature declares (the first ``len(reference)``)."""
    if len(outputs) < len(reference):
        raise RuntimeError(f"{len(outputs)} outputs, the reference has {len(reference)}")
    return max(
        float((o.float() - r.float()).abs().max()) if r.numel() else 0.0
        for o, r in zip(outputs, reference)
    )


# Lines the executorch runtime logs when a method fails, e.g.
# "[QnnExecuTorchBackend.cpp:163] Method forward: ... disagree on the delegate signature".
_RUNTIME_ERROR = re.compile(r"^\[[\w.]+\.cpp:\d+\] .*(fail|disagree|error|mismatch)", re.I)


def runtime_error_line(log: str) -> str | None:
    """The first error line the executorch runtime logged, if any."""
    for line in log.splitlines():
        if _RUNTIME_ERROR.search(line.strip()):
            return line.strip()
    return None


def child_failure(proc: subprocess.CompletedProcess) -> str:
    """One line: how a child process ended and the first runtime error it logged."""
    code = proc.returncode
    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
    lines = [line.strip() for line in (proc.stderr or "").splitlines() if line.strip()]
    detail = runtime_error_line(proc.stderr or "") or (lines[-1] if lines else "no output")
    return f"{how}: {detail}"


def _worker_run(pte: bytes, inputs: list[torch.Tensor], log_path: str) -> list[torch.Tensor]:
    """In the simulator worker: run with fd 2 sent to ``log_path`` (the runtime logs there)."""
    from qnn_convbwd.toolchain import harness

    sys.stderr.flush()
    saved = os.dup(2)
    with open(log_path, "wb") as log:
        os.dup2(log.fileno(), 2)
        try:
            return harness.run_pte(pte, inputs)
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


class Simulator:
    """Runs programs on the HTP simulator in a reusable child process.

    A delegate whose signature disagrees with its program makes the executorch
    runtime crash the process (SIGSEGV) after logging the error, so runs happen
    in a worker; a crash becomes a RuntimeError carrying that logged line, and
    the next run starts a new worker.
    """

    def __init__(
        self,
        timeout: float = 900.0,
        worker: Callable[[bytes, list[torch.Tensor], str], list[torch.Tensor]] = _worker_run,
    ) -> None:
        self.timeout = timeout
        self.worker = worker  # module-level function: it is imported by the spawned worker
        self._pool: Any = None

    def run(self, pte: bytes, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        import concurrent.futures
        import multiprocessing
        from concurrent.futures.process import BrokenProcessPool

        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn")
            )
        fd, log_path = tempfile.mkstemp(prefix="qnn_convbwd_run_", suffix=".log")
        os.close(fd)
        try:
            future = self._pool.submit(self.worker, pte, list(inputs), log_path)
            try:
                return future.result(timeout=self.timeout)
            except BrokenProcessPool:
                self.close()
                log = Path(log_path).read_text(errors="replace")
                detail = runtime_error_line(log) or "no runtime error logged"
                raise RuntimeError(f"simulator process crashed: {detail}") from None
            except Exception as err:
                detail = runtime_error_line(Path(log_path).read_text(errors="replace"))
                raise RuntimeError(error_text(err) + (f" ({detail})" if detail else "")) from err
        finally:
            os.unlink(log_path)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> Simulator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def record_fidelity(
    result: ModeResult,
    graph: Any,
    outputs: Sequence[torch.Tensor],
    reference: Sequence[torch.Tensor],
    floor: Sequence[torch.Tensor],
) -> None:
    """``result``'s fidelity cells: the run judged per tensor against ``reference`` (fp32
    autograd) next to ``floor``, torch's own fp16 step (``fidelity.assess``, the bound of
    docs/numerics.md)."""
    from . import fidelity

    report = fidelity.assess(graph.program, outputs, reference, floor)
    worst = report.worst()
    result.fidelity_outside = len(report.offending)
    result.fidelity_tensors = len(report.rows)
    result.fidelity_worst = f"{worst.name} {worst.htp.rel_l2:.2g} ({worst.floor.rel_l2:.2g})"


def forward_only_program(graph: Any) -> torch.export.ExportedProgram:
    """The model's forward and loss, exported without backward."""
    return torch.export.export(graph.model, graph.inputs, strict=True)


def measure_graph(
    spec: GraphSpec,
    soc: str,
    repeats: int,
    modes: Sequence[str] = MODES,
    simulator: Simulator | None = None,
) -> GraphResult:
    """Lower one graph in every mode; run each lowered program on ``simulator`` if given."""
    from qnn_convbwd import api
    from qnn_convbwd.toolchain import harness

    from . import fidelity
    from .models import training_graph

    specs = harness.compile_specs(soc)
    graph = training_graph(
        spec.backbone,
        size=spec.size,
        batch=spec.batch,
        channels=spec.channels,
        trainable_backbone=spec.trainable_backbone,
        depth=spec.depth,
    )
    reference = graph.reference()
    joint_nodes = sum(n.op == "call_function" for n in graph.program.graph.nodes)

    forward = forward_only_program(graph)
    forward_edge = lower_with_plugin(copy.deepcopy(forward), specs, None)
    forward_ctx = sum(len(b) for b in harness.context_binaries(forward_edge))
    forward_static, _ = static_bytes(forward, soc)
    forward_partitions = graph_counts(forward_edge.exported_program().graph_module)["partitions"]
    if forward_partitions != 1:
        logger.warning("%s: forward-only graph has %d partitions", spec.name, forward_partitions)

    floor: list[torch.Tensor] | None = None  # torch's fp16 step, computed once if a run needs it
    results: dict[str, ModeResult] = {}
    for mode in modes:
        result = ModeResult(mode)
        results[mode] = result
        if mode == "plain" and api.is_enabled():
            api.disable()
        logger.info("%s: lowering (%s)", spec.name, MODE_LABELS[mode])
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                edge, timings = timed_lowerings(_lowerer(mode, specs), graph.program, repeats)
            result.lower_seconds = timings.seconds
            result.lower_process_seconds = timings.process_seconds
        except Exception as err:
            result.error = error_text(err)
            logger.info("%s: %s lowering failed: %s", spec.name, mode, result.error)
            continue
        counts = graph_counts(edge.exported_program().graph_module)
        result.partitions = counts["partitions"]
        result.cpu_ops = counts["cpu_ops"]
        result.conv_bwd_on_cpu = counts["conv_bwd_on_cpu"]
        result.conv_bwd_delegated = counts["conv_bwd_delegated"]
        result.context_binary_bytes = sum(len(b) for b in harness.context_binaries(edge))
        if mode != "plain":
            skip = {CONV_BWD} if mode == "kept_on_cpu" else None
            result.static_bytes, result.static_bytes_note = static_bytes(graph.program, soc, skip)
            if result.static_bytes is not None and result.partitions > 1:
                result.static_bytes_note = f"first of {result.partitions} partitions"
        if simulator is not None:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    pte = edge.to_executorch().buffer
                outputs = simulator.run(pte, graph.inputs)
                result.extra_outputs = len(outputs) - len(reference)
                result.max_abs_error = compare(outputs, reference)
                if floor is None:
                    floor = fidelity.fp16_reference(graph.model, graph.inputs, graph.program)
                record_fidelity(result, graph, outputs, reference, floor)
            except Exception as err:
                result.run_error = error_text(err, limit=240)
                logger.warning("%s (%s): run failed: %s", spec.name, mode, result.run_error)
    return GraphResult(
        spec,
        count_conv_bwd(graph.program),
        joint_nodes,
        forward_static,
        forward_ctx,
        results,
    )


# --- scaling: one subprocess per point -------------------------------------------------


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field}")
    return int(match.group(1))


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS; False if not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def measure_point(point: dict) -> dict:
    """Lower one (backbone, depth, mode) point; meant to run in a process of its own.

    A warm-up lowering of the depth-1 graph at 8 px first pays the one-off costs
    (lazy imports, QNN backend libraries). Then the peak-RSS mark is reset, the
    measured graph is lowered, and ``peak_delta_kib`` is the peak RSS during that
    lowering minus the RSS just before it. Where the mark cannot be reset, the
    process-lifetime peak is used and ``peak_method`` says so.
    """
    import gc

    from qnn_convbwd.toolchain import ensure_sdk, harness

    from .models import training_graph

    ensure_sdk()
    specs = harness.compile_specs(point["soc"])
    lower = _lowerer(point["mode"], specs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warm = training_graph(point["backbone"], size=8, channels=point["channels"], depth=1)
        timed_lowerings(lower, warm.program, 1)
        del warm
        graph = training_graph(
            point["backbone"], size=point["size"], channels=point["channels"], depth=point["depth"]
        )
        gc.collect()
        method = "VmHWM reset before the lowering" if _reset_peak_rss() else "process peak"
        rss_before = _status_kib("VmRSS")
        edge, timings = timed_lowerings(lower, graph.program, 1)
        peak = _status_kib("VmHWM")
        if point["repeats"] > 1:
            timings.extend(timed_lowerings(lower, graph.program, point["repeats"] - 1)[1])
    counts = graph_counts(edge.exported_program().graph_module)
    return {
        **point,
        "joint_call_function_nodes": sum(
            n.op == "call_function" for n in graph.program.graph.nodes
        ),
        "conv_bwd_nodes": count_conv_bwd(graph.program),
        "parameter_bytes": sum(t.numel() * t.element_size() for t in graph.model.parameters()),
        "seconds": timings.seconds,
        "process_seconds": timings.process_seconds,
        "median_seconds": statistics.median(timings.seconds),
        "median_process_seconds": statistics.median(timings.process_seconds),
        "rss_before_kib": rss_before,
        "peak_rss_kib": peak,
        "peak_delta_kib": max(0, peak - rss_before),
        "peak_method": method,
        **counts,
    }


def run_point_subprocess(point: dict, timeout: float = 3600.0) -> dict:
    with tempfile.TemporaryDirectory(prefix="qnn_convbwd_bench_") as tmp:
        out = Path(tmp) / "point.json"
        cmd = [
            sys.executable,
            "-m",
            "qnn_convbwd_dev.bench",
            "point",
            json.dumps(point),
            str(out),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not out.exists():
            return {**point, "error": child_failure(proc)}
        return json.loads(out.read_text())


def scaling(
    backbone: str,
    depths: Sequence[int],
    size: int,
    soc: str,
    repeats: int,
    channels: int = 8,
    modes: Sequence[str] = SCALING_MODES,
) -> dict:
    points = []
    for depth in depths:
        for mode in modes:
            point = {
                "backbone": backbone,
                "depth": depth,
                "size": size,
                "channels": channels,
                "mode": mode,
                "soc": soc,
                "repeats": repeats,
            }
            start = time.perf_counter()
            points.append(run_point_subprocess(point))
            logger.info("scaling point %s: %.0f s", point, time.perf_counter() - start)
    return {"points": points, "summary": scaling_summary(points, depths, modes)}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def scaling_summary(
    points: Sequence[dict], depths: Sequence[int], modes: Sequence[str] = SCALING_MODES
) -> list:
    """Per depth and mode: growth over the first depth (time, memory, graph size).

    Per depth also the plugin / kept-on-CPU ratios: if the plugin added cost that
    grows faster than the graph, the ratio would rise with depth.
    """
    by = {(p["depth"], p["mode"]): p for p in points if "error" not in p}
    base = depths[0]
    rows = []
    for depth in depths:
        row: dict[str, Any] = {"depth": depth}
        for mode in modes:
            p, b = by.get((depth, mode)), by.get((base, mode))
            if p is None or b is None:
                row[mode] = None
                continue
            row[mode] = {
                "median_seconds": p["median_seconds"],
                "median_process_seconds": p["median_process_seconds"],
                "peak_delta_mib": p["peak_delta_kib"] / 1024,
                "time_growth": p["median_seconds"] / b["median_seconds"],
                "process_time_growth": p["median_process_seconds"] / b["median_process_seconds"],
                "memory_growth": _ratio(p["peak_delta_kib"], b["peak_delta_kib"]),
                "node_growth": p["joint_call_function_nodes"] / b["joint_call_function_nodes"],
                "parameter_growth": p["parameter_bytes"] / b["parameter_bytes"],
            }
        plugin, kept = row.get("plugin"), row.get("kept_on_cpu")
        if plugin and kept:
            row["time_ratio"] = plugin["median_seconds"] / kept["median_seconds"]
            row["process_time_ratio"] = (
                plugin["median_process_seconds"] / kept["median_process_seconds"]
            )
            row["memory_ratio"] = _ratio(plugin["peak_delta_mib"], kept["peak_delta_mib"])
        rows.append(row)
    return rows
