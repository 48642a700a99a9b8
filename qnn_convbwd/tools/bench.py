"""``qnn-convbwd bench``: training graphs lowered with and without the plugin.

Every reference graph (``qnn_convbwd.tools.models``) is lowered three ways in one run:

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
lowering seconds (median of ``--repeats``) and the maximum absolute error of the
program on the x86-64 HTP simulator against eager autograd. A lowering or run
that fails is recorded with its error, never hidden.

The scaling study lowers the same backbone at depth x1, x2, x4 in a fresh
subprocess per point (so peak RSS is per point) and reports growth factors.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import logging
import operator
import os
import platform
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

logger = logging.getLogger(__name__)

CONV_BWD = "aten.convolution_backward.default"
MODES = ("plugin", "kept_on_cpu", "plain")
MODE_LABELS = {
    "plugin": "plugin",
    "kept_on_cpu": "plugin, conv_bwd kept on CPU",
    "plain": "plain executorch 1.5.1",
}
DEFAULT_OUT = Path("docs") / "bench"


# --- what is measured ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GraphSpec:
    backbone: str
    size: int
    trainable_backbone: bool
    depth: int = 1
    channels: int = 8
    batch: int = 1

    @property
    def name(self) -> str:
        kind = "trainable" if self.trainable_backbone else "frozen"
        depth = "" if self.depth == 1 else f" x{self.depth}"
        return f"{self.backbone}{depth} {self.size}px {kind}"


@dataclasses.dataclass
class ModeResult:
    mode: str
    error: str | None = None  # lowering failed
    partitions: int | None = None
    cpu_ops: int | None = None
    conv_bwd_on_cpu: int | None = None
    conv_bwd_delegated: int | None = None
    static_bytes: int | None = None
    static_bytes_note: str = ""
    context_binary_bytes: int | None = None
    lower_seconds: list[float] = dataclasses.field(default_factory=list)
    lower_process_seconds: list[float] = dataclasses.field(default_factory=list)
    max_abs_error: float | None = None
    run_error: str | None = None  # lowered, but the program failed on the simulator
    extra_outputs: int | None = None  # program outputs beyond the graph signature's

    @property
    def median_seconds(self) -> float | None:
        return statistics.median(self.lower_seconds) if self.lower_seconds else None

    @property
    def median_process_seconds(self) -> float | None:
        seconds = self.lower_process_seconds
        return statistics.median(seconds) if seconds else None


@dataclasses.dataclass
class GraphResult:
    spec: GraphSpec
    conv_bwd_nodes: int
    joint_nodes: int
    forward_static_bytes: int | None
    forward_context_binary_bytes: int | None
    modes: dict[str, ModeResult]

    def to_json(self) -> dict:
        return {
            "graph": self.spec.name,
            "spec": dataclasses.asdict(self.spec),
            "conv_bwd_nodes": self.conv_bwd_nodes,
            "joint_call_function_nodes": self.joint_nodes,
            "forward_only": {
                "static_bytes": self.forward_static_bytes,
                "context_binary_bytes": self.forward_context_binary_bytes,
            },
            "modes": {
                name: {
                    **dataclasses.asdict(m),
                    "median_seconds": m.median_seconds,
                    "median_process_seconds": m.median_process_seconds,
                }
                for name, m in self.modes.items()
            },
        }


_PASS_FAILED = re.compile(r"running the '(\w+)' pass")


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def _inner(err: BaseException) -> BaseException | None:
    return err.__cause__ or (None if err.__suppress_context__ else err.__context__)


def error_text(err: BaseException, limit: int = 160) -> str:
    """One line for a table cell: the error and, when it wraps another, the root cause.

    executorch wraps a failing pass as ``Exception: An error occurred when running
    the 'I64toI32' pass after the following passes: [...]``; that becomes
    ``I64toI32 pass: <root cause>``.
    """
    root = err
    while (inner := _inner(root)) is not None:
        root = inner
    text = _first_line(err)
    if root is not err:
        failed = _PASS_FAILED.search(str(err))
        where = f"{failed.group(1)} pass" if failed else text
        text = f"{where}: {_first_line(root)}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _target_name(node: torch.fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target))


def graph_counts(graph_module: torch.fx.GraphModule) -> dict[str, int]:
    """Delegate partitions, CPU-resident call_function nodes, convolution_backward on CPU
    and inside the delegates.

    Counted on the lowered edge program (before ``to_executorch``, which adds
    memory-planning nodes): every top-level call_function node that is neither a
    delegate call nor a ``getitem`` runs on CPU. The lowering may split a
    convolution_backward into several (one per requested gradient), so the
    delegated ones are counted in each delegate's original graph.
    """
    from executorch.exir.lowered_backend_module import get_lowered_submodules

    partitions = cpu_ops = conv_bwd = 0
    for node in graph_module.graph.nodes:
        if node.op != "call_function":
            continue
        name = _target_name(node)
        if name == "executorch_call_delegate":
            partitions += 1
        elif node.target is not operator.getitem:
            cpu_ops += 1
            conv_bwd += name == CONV_BWD
    delegated = sum(
        n.op == "call_function" and _target_name(n) == CONV_BWD
        for _, module, _ in get_lowered_submodules(graph_module)
        for n in module.original_module.graph.nodes
    )
    return {
        "partitions": partitions,
        "cpu_ops": cpu_ops,
        "conv_bwd_on_cpu": conv_bwd,
        "conv_bwd_delegated": delegated,
    }


def count_conv_bwd(program: torch.export.ExportedProgram) -> int:
    """convolution_backward nodes of an aten-dialect program (before lowering)."""
    op = torch.ops.aten.convolution_backward.default
    return sum(n.op == "call_function" and n.target == op for n in program.graph.nodes)


# --- the three ways to lower ---------------------------------------------------------


def lower_with_plugin(program: torch.export.ExportedProgram, specs: list, skip: set | None) -> Any:
    """EdgeProgramManager from ``qnn_convbwd.lower`` (``skip`` is the skip_node_op_set)."""
    from .. import api

    return api.lower(program, specs, skip_node_op_set=skip).edge


def lower_plain(program: torch.export.ExportedProgram, specs: list) -> Any:
    """executorch 1.5.1's Qualcomm flow, plugin disabled, from an ExportedProgram.

    The same steps as ``executorch.backends.qualcomm.utils.utils.
    to_edge_transform_and_lower_to_qnn`` after its ``torch.export.export``.
    """
    from executorch.backends.qualcomm._passes.qnn_pass_manager import get_qnn_pass_manager_cls
    from executorch.backends.qualcomm.partition.qnn_partitioner import QnnPartitioner
    from executorch.backends.qualcomm.partition.utils import generate_qnn_executorch_option
    from executorch.backends.qualcomm.serialization.qc_schema_serialize import (
        flatbuffer_to_option,
    )
    from executorch.backends.qualcomm.utils.qnn_manager_lifecycle import QnnManagerContext
    from executorch.backends.qualcomm.utils.utils import qnn_edge_config
    from executorch.exir import to_edge_transform_and_lower

    from .. import api

    if api.is_enabled():
        raise RuntimeError("lower_plain needs the plugin disabled (qnn_convbwd.disable())")
    options = flatbuffer_to_option(generate_qnn_executorch_option(specs))
    pass_manager = get_qnn_pass_manager_cls(options.backend_options.backend_type)()
    aten_program = pass_manager.transform_for_export_pipeline(program)
    passes = pass_manager.get_to_edge_transform_passes(program, compiler_specs=specs)
    with QnnManagerContext({"forward": specs}):
        return to_edge_transform_and_lower(
            {"forward": aten_program},
            transform_passes={"forward": passes},
            partitioner={"forward": [QnnPartitioner(specs)]},
            compile_config=qnn_edge_config(),
        )


def _lowerer(mode: str, specs: list) -> Callable[[torch.export.ExportedProgram], Any]:
    if mode == "plugin":
        return lambda ep: lower_with_plugin(ep, specs, None)
    if mode == "kept_on_cpu":
        return lambda ep: lower_with_plugin(ep, specs, {CONV_BWD})
    if mode == "plain":
        return lambda ep: lower_plain(ep, specs)
    raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")


@dataclasses.dataclass
class Timings:
    seconds: list[float] = dataclasses.field(default_factory=list)  # wall clock
    # CPU time of this process (all threads): steadier than wall time on a shared machine.
    process_seconds: list[float] = dataclasses.field(default_factory=list)

    def extend(self, other: Timings) -> None:
        self.seconds += other.seconds
        self.process_seconds += other.process_seconds


def timed_lowerings(
    lower: Callable[[torch.export.ExportedProgram], Any],
    program: torch.export.ExportedProgram,
    repeats: int,
) -> tuple[Any, Timings]:
    """Lower a fresh copy ``repeats`` times; the first edge program and every duration.

    The export passes mutate the program they are given, hence the copies (made
    outside the timed region). A failure raises on the first attempt.
    """
    first, timings = None, Timings()
    for _ in range(max(1, repeats)):
        fresh = copy.deepcopy(program)
        wall, cpu = time.perf_counter(), time.process_time()
        edge = lower(fresh)
        timings.seconds.append(time.perf_counter() - wall)
        timings.process_seconds.append(time.process_time() - cpu)
        first = edge if first is None else first
    return first, timings


# --- static bytes through the Saver recorder (optional) ------------------------------


def saver_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("qnn_convbwd.toolchain.saver") is not None


def static_bytes(
    program: torch.export.ExportedProgram, soc: str, skip: set | None = None
) -> tuple[int | None, str]:
    """Bytes of STATIC tensors in the recorded QNN graph, or (None, why not)."""
    if not saver_available():
        return None, "n/a: qnn_convbwd.toolchain.saver not available"
    import inspect

    from ..toolchain import saver

    kwargs: dict[str, Any] = {}
    if skip:
        if "skip_node_op_set" not in inspect.signature(saver.record).parameters:
            return None, "n/a: saver.record takes no skip_node_op_set"
        kwargs["skip_node_op_set"] = skip
    try:
        graph = saver.record(copy.deepcopy(program), soc, **kwargs)
    except Exception as err:  # recorded in the report, not fatal for the bench
        logger.warning("saver.record failed: %s", error_text(err))
        return None, f"n/a: {error_text(err)}"
    return int(graph.static_bytes), ""


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
    from ..toolchain import harness

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
    from .. import api
    from ..toolchain import harness
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


SCALING_MODES = ("plugin", "kept_on_cpu")


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

    from ..toolchain import ensure_sdk, harness
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
            "qnn_convbwd.tools.bench",
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


def markdown_table(results: Sequence[GraphResult]) -> str:
    head = (
        "| graph | lowering | partitions | CPU ops | conv_bwd on CPU | static bytes "
        "(joint / fwd-only) | context bytes (joint / fwd-only) | lower s wall / CPU "
        "| max abs err | note |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in results:
        for mode, m in r.modes.items():
            label = MODE_LABELS[mode]
            fwd_static = _bytes_cell(r.forward_static_bytes)
            fwd_ctx = _bytes_cell(r.forward_context_binary_bytes)
            if m.error:
                lines.append(
                    f"| {r.spec.name} | {label} | — | — | — | — | — | — | — | "
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
                f"{_error_cell(m)} | {note} |"
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
    cmd = [sys.executable, "-m", "qnn_convbwd.tools.bench", "chart", str(report_path), str(out)]
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


def environment(soc: str) -> dict:
    from .. import integration
    from ..toolchain import SdkUnavailable, ensure_sdk

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
        "saver": saver_available(),
    }


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
            "autograd over the outputs the graph signature declares. Static bytes come from a "
            "Saver recording of the first QNN partition."
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

    ``python -m qnn_convbwd.tools.bench point POINT_JSON OUT_JSON``: one scaling point.
    ``python -m qnn_convbwd.tools.bench chart REPORT_JSON OUT_DIR``: draw the charts.
    """
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("executorch").setLevel(logging.WARNING)
    if argv[0] == "point":
        point, out = json.loads(argv[1]), Path(argv[2])
        out.write_text(json.dumps(measure_point(point)))
        return 0
    if argv[0] == "chart":
        for path in _draw_from_report(Path(argv[1]), Path(argv[2])):
            print(path)
        return 0
    raise SystemExit(f"unknown child command {argv[0]!r}")


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
