"""Where a training step's host time goes: every CPU op, the delegate calls, the optimizer.

On the x86-64 HTP simulator a delegate call is an emulation of the HTP that takes
nearly the whole step; the CPU ops around it (weights permuted into the filter layout
and gradients back, running-statistic updates, dropout masks, copies) are real CPU
time, and on a phone, where the HTP part of a small step takes milliseconds, they
decide whether training on the NPU beats training on the CPU.

``profile_program`` runs a few steps of a lowered training program through
``training.TrainingSession`` made with ``etdump=True`` (the program loaded as
``executorch.runtime``'s ``Runtime.load_program(enable_etdump=True)`` loads it),
reads the ETDump with ``executorch.devtools.Inspector`` and reports, per step:

* every CPU op's time, aggregated by op with its call count (an instruction's
  ``OPERATOR_CALL`` event, named by its kernel's ``native_call_<op>`` event);
* the delegate calls (``DELEGATE_CALL``), which on this host are simulator time;
* the optimizer: executorch's SGD as the session applies it
  (``TrainingSession.optimizer_step``), timed in Python around the call;
* the bytes into and out of each delegate: every input and output tensor of each
  ``executorch_call_delegate`` node of the lowered program (dtype size x numel),
  each with its role (a parameter, a program input, a gradient, a buffer update,
  the loss, or a tensor made or read by a CPU op).

``measure`` lowers one model for the NPU (``--soc``) and for SM8350 (HTP V68, where
the whole training graph stays on executorch's CPU kernels) and profiles both in one
run; ``Profile.host_share`` is (CPU ops + optimizer of the NPU program) / (the
CPU-only program's step: its ``forward`` + optimizer). ``qnn-convbwd profile`` prints
the tables and writes the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from qnn_convbwd import training

logger = logging.getLogger(__name__)

CPU_SOC = "SM8350"  # HTP V68: the partition rules keep a training graph on CPU as a whole
# Nodes a tensor passes through unchanged in value between a delegate and where it comes
# from or goes to (layout moves and copies on CPU): followed to name its role.
_PASS_THROUGH = ("permute_copy", "_to_dim_order_copy", "_clone_dim_order", "view_copy", "clone")


class ProfileError(RuntimeError):
    """An ETDump or a program that does not have what the profile reads."""


# --- tensors in and out of the delegates ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str  # the edge program's node
    dtype: str  # torch dtype without "torch."
    shape: tuple[int, ...]
    # in: parameter, input (a program input), buffer, cpu (made by a CPU op);
    # out: loss, output, gradient, buffer (written into one), cpu (read by a CPU op), unused
    role: str

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * getattr(torch, self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class DelegateIO:
    """One delegate call's input and output tensors (per call, so per step)."""

    index: int  # position among the program's delegate calls
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]

    @property
    def bytes_in(self) -> int:
        return sum(t.nbytes for t in self.inputs)

    @property
    def bytes_out(self) -> int:
        return sum(t.nbytes for t in self.outputs)


def _op(node: torch.fx.Node) -> str:
    """The op of an edge node without namespace and overload (``permute_copy``)."""
    text = str(node.target)
    if text.startswith("<EdgeOpOverload: "):
        text = text[len("<EdgeOpOverload: ") : text.index(">")]
    parts = text.split(".")
    return parts[1] if len(parts) >= 3 else parts[0]


def _source_role(node: torch.fx.Node, signature: Any) -> str:
    while node.op == "call_function" and _op(node) in _PASS_THROUGH:
        node = node.args[0]
    if node.op != "placeholder":
        return "cpu"
    if node.name in signature.inputs_to_parameters:
        return "parameter"
    if node.name in signature.inputs_to_buffers:
        return "buffer"
    return "input"


def _sink_role(node: torch.fx.Node, positions: dict[torch.fx.Node, int], gradients_at: int) -> str:
    """What becomes of a delegate output: the loss or another method output (before
    ``gradients_at``), a gradient, a buffer update (a ``copy_`` into a buffer), or a
    tensor CPU ops read."""
    while True:
        if node in positions:
            at = positions[node]
            return "gradient" if at >= gradients_at else "loss" if at == 0 else "output"
        users = list(node.users)
        if len(users) != 1 or users[0].op != "call_function":
            return "cpu"
        user = users[0]
        if _op(user) == "copy_" and user.args[0].op == "placeholder":
            return "buffer"
        if _op(user) not in _PASS_THROUGH:
            return "cpu"
        node = user


def _info(node: torch.fx.Node, value: Any, role: str) -> TensorInfo:
    return TensorInfo(node.name, str(value.dtype).replace("torch.", ""), tuple(value.shape), role)


def delegate_io(edge: Any, gradients_at: int | None = None) -> list[DelegateIO]:
    """Every delegate call of a lowered program (an EdgeProgramManager) in graph order,
    with its input and output tensors and their roles. ``gradients_at``: where the
    ``forward`` method's gradients start among its outputs (``training_indices``);
    without it no output is called a gradient."""
    program = edge.exported_program()
    signature = program.graph_signature
    graph = program.graph
    # Method outputs by position (the graph's, as to_executorch left it: its output specs
    # no longer line up with them once buffer mutations are written in place).
    positions: dict[torch.fx.Node, int] = {}
    for at, node in enumerate(graph.output_node().args[0]):
        if isinstance(node, torch.fx.Node):
            positions.setdefault(node, at)
    if gradients_at is None:
        gradients_at = len(positions) + 1
    found = []
    for node in graph.nodes:
        if node.op != "call_function" or "executorch_call_delegate" not in str(node.target):
            continue
        inputs = tuple(
            _info(arg, arg.meta["val"], _source_role(arg, signature))
            for arg in node.args[1:]
            if isinstance(arg, torch.fx.Node) and isinstance(arg.meta.get("val"), torch.Tensor)
        )
        values = node.meta["val"]
        if isinstance(values, list | tuple):  # read by getitem nodes, one per output
            readers = {u.args[1]: u for u in node.users if u.op == "call_function"}
            pairs = [(readers.get(k), v) for k, v in enumerate(values)]
        else:
            pairs = [(node, values)]
        outputs = tuple(
            TensorInfo(
                f"{node.name}[{k}]" if reader is None else reader.name,
                str(value.dtype).replace("torch.", ""),
                tuple(value.shape),
                "unused" if reader is None else _sink_role(reader, positions, gradients_at),
            )
            for k, (reader, value) in enumerate(pairs)
            if isinstance(value, torch.Tensor)
        )
        found.append(DelegateIO(len(found), inputs, outputs))
    return found


def training_indices(pte: bytes) -> tuple[int, int]:
    """Where the gradients and the parameters start among a training program's ``forward``
    outputs (its ``__et_training_*_index_forward`` methods, run by executorch.runtime)."""
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(pte)
    return tuple(  # type: ignore[return-value]
        int(program.load_method(f"__et_training_{what}_index_forward").execute([])[0])
        for what in ("gradients", "parameters")
    )


# --- the ETDump ---------------------------------------------------------------------------


@dataclasses.dataclass
class OpTime:
    """One kind of CPU op of one step: calls and milliseconds (means over the profiled
    steps) and each profiled step's milliseconds."""

    op: str
    calls: int
    ms: float
    per_step_ms: list[float] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Timings:
    """What the ETDump says of the ``forward`` runs kept (per step, means)."""

    cpu_ops: list[OpTime]  # by op, largest first
    delegate_calls: int
    delegate_ms: float
    execute_ms: float  # Method::execute
    per_step_execute_ms: list[float]
    per_step_delegate_ms: list[float]

    @property
    def cpu_ms(self) -> float:
        return sum(op.ms for op in self.cpu_ops)

    @property
    def cpu_calls(self) -> int:
        return sum(op.calls for op in self.cpu_ops)

    @property
    def per_step_cpu_ms(self) -> list[float]:
        """Every CPU op's milliseconds summed, step by step."""
        if not self.cpu_ops:  # every op delegated: no CPU time in any step
            return [0.0] * len(self.per_step_execute_ms)
        return [sum(step) for step in zip(*(op.per_step_ms for op in self.cpu_ops))]


def _op_name(event_name: str) -> str:
    """``native_call_where.self_out`` -> ``where.self``, ``native_call_relu.out`` -> ``relu``."""
    name = event_name[len("native_call_") :]
    if name.endswith(".out"):
        return name[: -len(".out")]
    return name[: -len("_out")] if name.endswith("_out") else name


def read_etdump(etdump_path: str | Path, runs: int, skip: int = 0) -> Timings:
    """The ``forward`` method's instructions from an ETDump of ``runs`` executions of it
    (other methods run once may be in the dump too), the first ``skip`` runs left out.

    Each instruction is timed by its ``OPERATOR_CALL`` event (the runtime's whole call,
    the kernel's ``native_call_<op>`` event inside it names the op) or its
    ``DELEGATE_CALL`` event; events the delegate itself reports are not CPU ops.
    """
    from executorch.devtools import Inspector

    if not 0 <= skip < runs:
        raise ValueError(f"skip={skip} must leave at least one of the {runs} runs")
    inspector = Inspector(etdump_path=str(etdump_path))
    # The metadata methods a session runs once each hold no instruction (their blocks
    # merge into one of as many executions as there are methods).
    blocks = [
        b
        for b in inspector.event_blocks
        if any(
            e.name == "Method::execute" and e.perf_data and len(e.perf_data.raw) == runs
            for e in b.events
        )
        and any(e.name in ("OPERATOR_CALL", "DELEGATE_CALL") for e in b.events)
    ]
    if not blocks:
        raise ProfileError(f"{etdump_path}: no block of events with {runs} executions")
    block = max(blocks, key=lambda b: len(b.events))
    execute = next(e for e in block.events if e.name == "Method::execute")
    names: dict[int, str] = {}
    calls: dict[int, list[float]] = {}
    delegates: dict[int, list[float]] = {}
    for event in block.events:
        if event.is_delegated_op or event.perf_data is None:
            continue
        raw = list(event.perf_data.raw)
        if len(raw) != runs:
            raise ProfileError(
                f"{etdump_path}: event {event.name} of instruction {event._instruction_id} "
                f"ran {len(raw)} times in {runs} executions"
            )
        instruction = event._instruction_id
        if event.name.startswith("native_call_"):
            names[instruction] = _op_name(event.name)
            calls.setdefault(instruction, raw)  # an OPERATOR_CALL, when present, replaces it
        elif event.name == "OPERATOR_CALL":
            calls[instruction] = raw
        elif event.name == "DELEGATE_CALL":
            delegates[instruction] = raw
    unnamed = sorted(set(calls) - set(names))
    if unnamed:
        raise ProfileError(f"{etdump_path}: operator calls without a kernel name: {unnamed}")
    kept = runs - skip
    by_op: dict[str, list[float]] = {}
    counts: dict[str, int] = {}
    for instruction, raw in calls.items():
        op = names[instruction]
        totals = by_op.setdefault(op, [0.0] * kept)
        for k, ms in enumerate(raw[skip:]):
            totals[k] += ms
        counts[op] = counts.get(op, 0) + 1
    ops = [OpTime(op, counts[op], sum(t) / kept, t) for op, t in by_op.items()]
    ops.sort(key=lambda o: -o.ms)
    per_delegate = [sum(raw[skip + k] for raw in delegates.values()) for k in range(kept)]
    per_execute = list(execute.perf_data.raw[skip:])
    return Timings(
        cpu_ops=ops,
        delegate_calls=len(delegates),
        delegate_ms=sum(per_delegate) / kept,
        execute_ms=sum(per_execute) / kept,
        per_step_execute_ms=per_execute,
        per_step_delegate_ms=per_delegate,
    )


# --- one program, profiled ------------------------------------------------------------


@dataclasses.dataclass
class ProgramProfile:
    label: str
    soc: str
    delegates: list[DelegateIO]
    timings: Timings
    optimizer_ms: float  # executorch's SGD, per step (mean)
    per_step_optimizer_ms: list[float]
    forward_wall_ms: float  # TrainingSession.forward_backward in Python, per step (mean)
    losses: list[float]  # every step's, warm-up included
    lowering_seconds: float | None = None

    @property
    def step_ms(self) -> float:
        """One step as the runtime runs it: ``forward`` + the optimizer."""
        return self.timings.execute_ms + self.optimizer_ms

    @property
    def host_ms(self) -> float:
        """The CPU's part of a step: every CPU op and the optimizer."""
        return self.timings.cpu_ms + self.optimizer_ms

    @property
    def bytes_in(self) -> int:
        return sum(d.bytes_in for d in self.delegates)

    @property
    def bytes_out(self) -> int:
        return sum(d.bytes_out for d in self.delegates)

    def bytes_by(self, direction: str) -> dict[tuple[str, str], int]:
        """(role, dtype) -> bytes per step of ``direction`` ("in" or "out")."""
        totals: dict[tuple[str, str], int] = {}
        for d in self.delegates:
            for t in d.inputs if direction == "in" else d.outputs:
                totals[(t.role, t.dtype)] = totals.get((t.role, t.dtype), 0) + t.nbytes
        return totals


def profile_program(
    program: training.TrainingProgram,
    inputs: Sequence[torch.Tensor],
    *,
    label: str,
    soc: str,
    steps: int = 3,
    warmup: int = 1,
    lr: float = 0.01,
    momentum: float = 0.0,
) -> ProgramProfile:
    """``warmup + steps`` training steps of ``program`` on ``inputs`` through a
    ``TrainingSession`` recording its ETDump; the warm-up steps (the first execution
    initialises the delegates) are left out of the means."""
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps={steps} must be at least 1 and warmup={warmup} at least 0")
    session = program.session(lr, momentum=momentum, etdump=True)
    try:
        losses, optimizer, forward = [], [], []
        for _ in range(warmup + steps):
            start = time.perf_counter()
            outputs = session.forward_backward(list(inputs))
            middle = time.perf_counter()
            session.optimizer_step()
            end = time.perf_counter()
            losses.append(float(outputs[0]))
            forward.append((middle - start) * 1e3)
            optimizer.append((end - middle) * 1e3)
        with tempfile.TemporaryDirectory() as folder:
            etdump = Path(folder, "profile.etdp")
            session.write_etdump(str(etdump), str(Path(folder, "debug.bin")))
            timings = read_etdump(etdump, warmup + steps, skip=warmup)
    finally:
        session.close()
    kept = optimizer[warmup:]
    return ProgramProfile(
        label=label,
        soc=soc,
        delegates=delegate_io(program.edge, training_indices(program.pte)[0]),
        timings=timings,
        optimizer_ms=sum(kept) / steps,
        per_step_optimizer_ms=kept,
        forward_wall_ms=sum(forward[warmup:]) / steps,
        losses=losses,
        lowering_seconds=program.lowering_seconds,
    )


# --- a model, on the NPU and on the CPU -------------------------------------------------


@dataclasses.dataclass
class Profile:
    model: str
    scheme: str
    batch: int
    size: int
    steps: int
    npu: ProgramProfile
    cpu: ProgramProfile | None

    @property
    def host_share(self) -> float | None:
        """(CPU ops + optimizer of the NPU program) / the CPU-only program's step."""
        if self.cpu is None or self.cpu.step_ms <= 0:
            return None
        return self.npu.host_ms / self.cpu.step_ms

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        data["host_share"] = self.host_share
        return data

    @classmethod
    def from_json(cls, data: dict) -> Profile:
        def program(d: dict | None) -> ProgramProfile | None:
            if d is None:
                return None
            t = d["timings"]
            timings = Timings(
                cpu_ops=[OpTime(**o) for o in t["cpu_ops"]],
                **{k: v for k, v in t.items() if k != "cpu_ops"},
            )

            def tensors(items: list) -> tuple[TensorInfo, ...]:
                return tuple(TensorInfo(**{**i, "shape": tuple(i["shape"])}) for i in items)

            delegates = [
                DelegateIO(x["index"], tensors(x["inputs"]), tensors(x["outputs"]))
                for x in d["delegates"]
            ]
            rest = {k: v for k, v in d.items() if k not in ("timings", "delegates")}
            return ProgramProfile(delegates=delegates, timings=timings, **rest)

        rest = {k: v for k, v in data.items() if k not in ("npu", "cpu", "host_share")}
        return cls(npu=program(data["npu"]), cpu=program(data["cpu"]), **rest)


def lower(
    arch: str,
    scheme: str,
    batch: int,
    size: int,
    soc: str,
    *,
    seed: int = 0,
    dropout: bool = True,
    lower_options: dict | None = None,
) -> tuple[training.TrainingProgram, tuple[torch.Tensor, torch.Tensor]]:
    """``arch`` in ``train()`` with ``scheme`` (``zoo.train_mode_batch``; dropout drops
    unless ``dropout`` is false), cross-entropy, lowered for ``soc`` with the plugin's
    options ``lower_options`` (``qnn_convbwd.enabled``); and its batch."""
    import qnn_convbwd

    from . import zoo

    net, x, y = zoo.train_mode_batch(arch, scheme, batch, size, seed, dropout=dropout)
    module = training.WithLoss(net, torch.nn.CrossEntropyLoss())
    options = {"dropout_seed": seed, **(lower_options or {})}
    with qnn_convbwd.enabled(**options):
        program = training.lower_for_training(module, (x, y), qnn_convbwd.compile_specs(soc))
    return program, (x, y)


def measure(
    arch: str,
    scheme: str = "full",
    *,
    batch: int = 16,
    size: int = 32,
    steps: int = 3,
    warmup: int = 1,
    soc: str = "SM8650",
    cpu_baseline: bool = True,
    seed: int = 0,
    dropout: bool = True,
    lower_options: dict | None = None,
) -> Profile:
    """``arch`` lowered for ``soc`` and (``cpu_baseline``) for SM8350, each profiled
    over ``steps`` steps after ``warmup``, on the same batch and initial weights."""
    results = []
    for target in [soc] + ([CPU_SOC] if cpu_baseline else []):
        program, inputs = lower(
            arch,
            scheme,
            batch,
            size,
            target,
            seed=seed,
            dropout=dropout,
            lower_options=lower_options,
        )
        label = "CPU only" if target == CPU_SOC else "NPU"
        logger.info(
            "%s %s for %s: lowered in %.1f s", arch, scheme, target, program.lowering_seconds
        )
        results.append(
            profile_program(program, inputs, label=label, soc=target, steps=steps, warmup=warmup)
        )
        del program
    return Profile(
        arch, scheme, batch, size, steps, results[0], results[1] if len(results) > 1 else None
    )


# --- text -------------------------------------------------------------------------------


def _ms(value: float) -> str:
    return f"{value:,.2f}" if value < 100 else f"{value:,.0f}"


def to_markdown(profile: Profile) -> str:
    programs = [p for p in (profile.npu, profile.cpu) if p is not None]
    head = " | ".join(f"{p.label} ({p.soc}) calls | ms" for p in programs)
    lines = [
        f"### {profile.model} {profile.scheme}, train(), batch {profile.batch}, "
        f"{profile.size}x{profile.size}: ms per step, mean of {profile.steps} steps",
        "",
        f"| | {head} |",
        "|---|" + "---|---|" * len(programs),
    ]
    ops: list[str] = []
    for p in programs:
        ops += [o.op for o in p.timings.cpu_ops if o.op not in ops]
    tables = [{o.op: o for o in p.timings.cpu_ops} for p in programs]

    def row(label: str, cells: list[tuple[str, str]]) -> None:
        lines.append(f"| {label} | " + " | ".join(f"{a} | {b}" for a, b in cells) + " |")

    for op in ops:
        row(op, [(str(t[op].calls), _ms(t[op].ms)) if op in t else ("-", "-") for t in tables])
    row(
        "**CPU ops**",
        [(f"**{p.timings.cpu_calls}**", f"**{_ms(p.timings.cpu_ms)}**") for p in programs],
    )
    row(
        "delegate calls (x86 HTP simulator)",
        [
            (str(p.timings.delegate_calls), _ms(p.timings.delegate_ms))
            if p.timings.delegate_calls
            else ("-", "-")
            for p in programs
        ],
    )
    row("forward (Method::execute)", [("", _ms(p.timings.execute_ms)) for p in programs])
    row("optimizer (executorch SGD)", [("", _ms(p.optimizer_ms)) for p in programs])
    row("**host: CPU ops + optimizer**", [("", f"**{_ms(p.host_ms)}**") for p in programs])
    row("step: forward + optimizer", [("", _ms(p.step_ms)) for p in programs])
    lines.append("")
    for p in programs:
        steps = p.timings.per_step_cpu_ms
        lines.append(f"{p.label}: CPU ops per profiled step {', '.join(_ms(x) for x in steps)} ms.")
    lines.append("")
    share = profile.host_share
    if share is not None:
        lines.append(
            f"Host share: (CPU ops + optimizer) / CPU-only step = {_ms(profile.npu.host_ms)} / "
            f"{_ms(profile.cpu.step_ms)} ms = **{share:.3f}**."  # type: ignore[union-attr]
        )
        lines.append("")
    for p in programs:
        if not p.delegates:
            continue
        lines += [
            f"Bytes into and out of the delegates of the {p.label} program, per step: "
            f"{p.bytes_in:,} in, {p.bytes_out:,} out ({len(p.delegates)} delegate(s)).",
            "",
            "| direction | role | dtype | tensors | bytes |",
            "|---|---|---|---|---|",
        ]
        for direction in ("in", "out"):
            counts: dict[tuple[str, str], int] = {}
            for d in p.delegates:
                for t in d.inputs if direction == "in" else d.outputs:
                    counts[(t.role, t.dtype)] = counts.get((t.role, t.dtype), 0) + 1
            for (role, dtype), nbytes in sorted(
                p.bytes_by(direction).items(), key=lambda kv: -kv[1]
            ):
                lines.append(
                    f"| {direction} | {role} | {dtype} | {counts[(role, dtype)]} | {nbytes:,} |"
                )
        lines.append("")
    return "\n".join(lines)


# --- CLI: qnn-convbwd profile -------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from qnn_convbwd import finetune

    parser.add_argument(
        "--model",
        default="cifar",
        help="cifar (ExecuTorch's CIFAR-10 example) or a torchvision classifier "
        "(resnet18, mobilenet_v2, ...)",
    )
    parser.add_argument("--scheme", choices=finetune.SCHEMES, default="full")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=32, help="input height and width")
    parser.add_argument("--steps", type=int, default=3, help="steps profiled after the warm-up")
    parser.add_argument("--warmup", type=int, default=1, help="steps run first, not counted")
    parser.add_argument("--soc", default="SM8650", help="the NPU program's SoC")
    parser.add_argument(
        "--no-cpu-baseline",
        dest="cpu_baseline",
        action="store_false",
        help=f"skip the CPU-only program ({CPU_SOC})",
    )
    parser.add_argument(
        "--no-dropout",
        dest="dropout",
        action="store_false",
        help="dropout modules in eval() (by default they drop, as in train())",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE", help="write the profile as JSON")
    parser.add_argument(
        "--from-json", metavar="FILE", help="print the tables of a profile written by --json"
    )


def run(args: argparse.Namespace) -> int:
    if args.from_json:
        print(to_markdown(Profile.from_json(json.loads(Path(args.from_json).read_text()))))
        return 0
    profile = measure(
        args.model,
        args.scheme,
        batch=args.batch,
        size=args.size,
        steps=args.steps,
        warmup=args.warmup,
        soc=args.soc,
        cpu_baseline=args.cpu_baseline,
        seed=args.seed,
        dropout=args.dropout,
    )
    print(to_markdown(profile))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(profile.to_json(), indent=1))
        print(f"JSON: {args.json}")
    return 0
