"""Where the time of ``qnn_convbwd.lower()`` goes: one measurement per phase.

``timed()`` wraps, for the duration of a block, the steps of executorch's
Qualcomm flow that ``lower()`` runs:

* ``export passes``: the plugin's ``_qualcomm_passes`` (train-mode rewrite,
  executorch's export pipeline, the to_edge transform pass list);
* ``partition``: ``QnnPartitioner.partition`` (executorch's and the plugin's);
* per delegate, ``build``: ``QnnBackend._build_op_wrappers`` (executorch's
  preprocess passes and every node visitor making QNN ops);
* per delegate, ``finalise``: from the end of that build to the end of the
  backend call or the start of the next build. That is QNN's graph
  finalisation and context serialisation (``qnn_manager.Compile``, which the
  Python side cannot wrap), plus the context set-up and tear-down around it.

The rest of ``lower()`` (to_edge, its transform passes, emitting the delegate
calls) is ``total - export passes - partition - backend``.

The wrappers go on top of the plugin's own patches, so ``timed()`` must be
entered inside ``qnn_convbwd.enabled()``; leaving the block restores the
wrapped attributes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import time
from collections import Counter
from collections.abc import Iterator

import torch

from qnn_convbwd import api, integration


@dataclasses.dataclass
class Delegate:
    build_s: float
    finalise_s: float = 0.0
    qnn_ops: Counter = dataclasses.field(default_factory=Counter)

    @property
    def op_count(self) -> int:
        return sum(self.qnn_ops.values())


@dataclasses.dataclass
class Timing:
    total_s: float = 0.0
    export_passes_s: float = 0.0
    partition_s: float = 0.0
    backend_s: float = 0.0
    delegates: list[Delegate] = dataclasses.field(default_factory=list)

    @property
    def build_s(self) -> float:
        return sum(d.build_s for d in self.delegates)

    @property
    def finalise_s(self) -> float:
        return sum(d.finalise_s for d in self.delegates)

    @property
    def rest_s(self) -> float:
        return self.total_s - self.export_passes_s - self.partition_s - self.backend_s

    def qnn_ops(self) -> Counter:
        return sum((d.qnn_ops for d in self.delegates), Counter())


_PREPROCESS_MODULE = "executorch.backends.qualcomm.qnn_preprocess"
_BACKEND_CALLS = ("QnnBackend.preprocess", "QnnBackend.preprocess_multimethod")


def _op_type(wrapper: object) -> str:
    """The QNN op type; a Transpose also names its rank (QAIRT's cost depends on it)."""
    op = wrapper.GetOpWrapper()
    kind = op.GetOpType()
    if kind == "Transpose":
        rank = len(op.GetOpConfig()["inputTensors"][0].v2.dimensions)
        return f"{kind} (rank {rank})"
    return kind


@contextlib.contextmanager
def timed() -> Iterator[Timing]:
    """Record a ``Timing`` of the lowerings run in the block (sums over all of them)."""
    if not api.is_enabled():
        raise RuntimeError("lowering_time.timed() goes inside qnn_convbwd.enabled()")
    timing = Timing()
    for name in ("QnnBackend._build_op_wrappers", *_BACKEND_CALLS):
        integration.get(name)  # fails loudly, naming the executorch version
    backend = importlib.import_module(_PREPROCESS_MODULE).QnnBackend
    partitioner = integration.get("QnnPartitioner")
    originals = {
        "build": backend.__dict__["_build_op_wrappers"],
        "preprocess": backend.__dict__["preprocess"],
        "multimethod": backend.__dict__["preprocess_multimethod"],
        "partition": partitioner.__dict__["partition"],
        "passes": api._qualcomm_passes,
    }
    last_build_end: list[float] = []

    def close_finalise(now: float) -> None:
        if last_build_end and timing.delegates:
            timing.delegates[-1].finalise_s += now - last_build_end.pop()

    def build(*args, **kwargs):
        start = time.perf_counter()
        close_finalise(start)
        wrappers = originals["build"].__func__(*args, **kwargs)
        end = time.perf_counter()
        ops = Counter(_op_type(w) for w in wrappers) if isinstance(wrappers, list) else Counter()
        timing.delegates.append(Delegate(end - start, qnn_ops=ops))
        last_build_end.append(end)
        return wrappers

    def backend_call(name: str):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return originals[name].__func__(*args, **kwargs)
            finally:
                end = time.perf_counter()
                close_finalise(end)
                timing.backend_s += end - start

        return call

    def partition(self, edge_program):
        start = time.perf_counter()
        try:
            return originals["partition"](self, edge_program)
        finally:
            timing.partition_s += time.perf_counter() - start

    def passes(*args, **kwargs):
        start = time.perf_counter()
        try:
            return originals["passes"](*args, **kwargs)
        finally:
            timing.export_passes_s += time.perf_counter() - start

    backend._build_op_wrappers = staticmethod(build)
    backend.preprocess = staticmethod(backend_call("preprocess"))
    backend.preprocess_multimethod = staticmethod(backend_call("multimethod"))
    partitioner.partition = partition
    api._qualcomm_passes = passes
    try:
        yield timing
    finally:
        backend._build_op_wrappers = originals["build"]
        backend.preprocess = originals["preprocess"]
        backend.preprocess_multimethod = originals["multimethod"]
        partitioner.partition = originals["partition"]
        api._qualcomm_passes = originals["passes"]


def measure(
    program: torch.export.ExportedProgram, compiler_specs: list, **overrides: object
) -> tuple[Timing, object]:
    """``(Timing, LoweringResult)`` of one ``qnn_convbwd.lower()`` of ``program``, with
    the options ``overrides`` (``qnn_convbwd.enabled(**overrides)``)."""
    with api.enabled(**overrides), timed() as timing:
        start = time.perf_counter()
        result = api.lower(program, compiler_specs)
        timing.total_s = time.perf_counter() - start
    return timing, result


def aten_ops(program: torch.export.ExportedProgram) -> Counter:
    """The program's ``call_function`` nodes by target name."""
    return Counter(
        getattr(n.target, "__name__", str(n.target))
        for n in program.graph.nodes
        if n.op == "call_function"
    )


def simulator_step_seconds(pte: bytes, inputs: list, steps: int) -> list[float]:
    """Seconds of each of ``steps`` SGD steps (lr 0.01) of a lowered joint program on
    the simulator (``training.TrainingSession``; the first includes loading its
    delegates)."""
    from qnn_convbwd import training

    session = training.TrainingSession(pte, 0.01)
    seconds = []
    try:
        for _ in range(steps):
            start = time.perf_counter()
            session.step(list(inputs))
            seconds.append(time.perf_counter() - start)
    finally:
        session.close()
    return seconds
