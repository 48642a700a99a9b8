"""The bench's three ways to lower a training graph (``plugin``, ``kept_on_cpu``,
``plain``), what is counted on a lowered program, and the measured records."""

from __future__ import annotations

import copy
import dataclasses
import logging
import operator
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from .bench_modes import MODES

logger = logging.getLogger(__name__)

CONV_BWD = "aten.convolution_backward.default"


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
    # ``fidelity`` of the run against fp32 autograd and torch's fp16 step (the floor):
    # tensors outside the bound (0: within), of how many, and the worst by relative L2.
    fidelity_outside: int | None = None
    fidelity_tensors: int | None = None
    fidelity_worst: str | None = None
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
    from qnn_convbwd import api

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

    from qnn_convbwd import api

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

    from qnn_convbwd.toolchain import saver

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
