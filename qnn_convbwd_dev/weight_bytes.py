"""How many times a frozen convolution's weight is stored in the compiled program.

For one convolution configuration and SoC, ``measure`` compiles three programs
that share the same frozen weight:

* ``fwd``: the forward convolution alone;
* ``fwd+bwd``: the forward convolution and ``aten.convolution_backward``
  (grad_input only) of the same weight, as a training step has them;
* ``bwd``: the backward alone;

and reports the ``.pte`` and QNN context-binary bytes of each, the weight's
bytes in the compiled precision (fp16: 2 bytes an element), and

    ratio = (context(fwd+bwd) - context(fwd)) / weight bytes

which is about 1.0 when the backward stores its own copy of the weight and
about 0 when the weight is stored once. It also runs the ``fwd+bwd`` program
on the x86-64 HTP simulator and compares the forward output and grad_input with
eager torch (``F.conv2d`` and ``torch.ops.aten.convolution_backward``), and
records which convolutions stayed on CPU: a ratio of 0 only counts when both
ops are delegated.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time

import torch
import torch.nn.functional as F
from torch import nn

from qnn_convbwd.toolchain import harness

logger = logging.getLogger(__name__)

PROGRAMS = ("fwd", "fwd+bwd", "bwd")
FP16_BYTES = 2

_SPEC = re.compile(r"^(\d+)x(\d+)x(\d+)((?::[sgnd]\d+)*)$")


@dataclasses.dataclass(frozen=True)
class ConvConfig:
    """A frozen ``Conv2d(c_in, c_out, kernel, stride, padding=kernel // 2, groups)``."""

    c_in: int
    c_out: int
    kernel: int = 3
    stride: int = 1
    groups: int = 1
    size: int = 8  # spatial size (square) of the forward input
    batch: int = 1
    bias: bool = True
    dilation: int = 1

    @property
    def padding(self) -> int:
        return self.dilation * (self.kernel // 2)

    @property
    def weight_shape(self) -> tuple[int, int, int, int]:
        return (self.c_out, self.c_in // self.groups, self.kernel, self.kernel)

    @property
    def weight_numel(self) -> int:
        c_out, c_in_g, kh, kw = self.weight_shape
        return c_out * c_in_g * kh * kw

    def weight_bytes(self, element_bytes: int = FP16_BYTES) -> int:
        return self.weight_numel * element_bytes

    def __str__(self) -> str:
        text = f"{self.c_out}x{self.c_in // self.groups}x{self.kernel}x{self.kernel}"
        extras = [f"s{self.stride}"] if self.stride != 1 else []
        extras += [f"g{self.groups}"] if self.groups != 1 else []
        extras += [f"d{self.dilation}"] if self.dilation != 1 else []
        return " ".join([text, *extras, f"@{self.size}px"])

    @classmethod
    def parse(cls, spec: str) -> ConvConfig:
        """``CINxCOUTxK`` with optional ``:sSTRIDE``, ``:gGROUPS``, ``:nSIZE``, ``:dDILATION``
        (e.g. 64x64x3:s2)."""
        match = _SPEC.match(spec.strip())
        if match is None:
            raise ValueError(f"config {spec!r} is not CINxCOUTxK[:sS][:gG][:nN][:dD]")
        c_in, c_out, kernel = (int(match.group(i)) for i in (1, 2, 3))
        extra = {"s": "stride", "g": "groups", "n": "size", "d": "dilation"}
        fields = {extra[item[0]]: int(item[1:]) for item in match.group(4).split(":") if item}
        return cls(c_in, c_out, kernel, **fields)


class FrozenConv(nn.Module):
    """One frozen convolution; ``program`` picks which of its ops ``forward`` returns."""

    def __init__(self, config: ConvConfig, program: str, seed: int = 0) -> None:
        super().__init__()
        if program not in PROGRAMS:
            raise ValueError(f"program {program!r} is not one of {PROGRAMS}")
        torch.manual_seed(seed)
        self.config = config
        self.program = program
        self.conv = nn.Conv2d(
            config.c_in,
            config.c_out,
            config.kernel,
            stride=config.stride,
            padding=config.padding,
            dilation=config.dilation,
            groups=config.groups,
            bias=config.bias,
        )
        self.conv.requires_grad_(False)

    def grad_input(self, x: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
        c = self.conv
        return torch.ops.aten.convolution_backward(
            grad_output,
            x,
            c.weight,
            None,
            list(c.stride),
            list(c.padding),
            list(c.dilation),
            False,
            [0, 0],
            c.groups,
            [True, False, False],
        )[0]

    def forward(self, x: torch.Tensor, grad_output: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.program == "fwd":
            return (self.conv(x),)
        if self.program == "bwd":
            return (self.grad_input(x, grad_output),)
        return self.conv(x), self.grad_input(x, grad_output)


def example_inputs(config: ConvConfig, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(config.batch, config.c_in, config.size, config.size, generator=gen)
    span = config.dilation * (config.kernel - 1) + 1
    out = (config.size + 2 * config.padding - span) // config.stride + 1
    grad_output = torch.randn(config.batch, config.c_out, out, out, generator=gen)
    return x, grad_output


def export(config: ConvConfig, program: str, seed: int = 0):
    """(module, inputs, ExportedProgram) of one of the three programs."""
    module = FrozenConv(config, program, seed).eval()
    inputs = example_inputs(config, seed)
    return module, inputs, torch.export.export(module, inputs, strict=False)


def reference(module: FrozenConv, inputs) -> list[torch.Tensor]:
    """Eager torch outputs: F.conv2d and aten.convolution_backward."""
    x, grad_output = inputs
    c = module.conv
    forward = F.conv2d(x, c.weight, c.bias, c.stride, c.padding, c.dilation, c.groups)
    backward = module.grad_input(x, grad_output)
    return {"fwd": [forward], "bwd": [backward], "fwd+bwd": [forward, backward]}[module.program]


def convolutions_on_cpu(compiled: harness.Compiled) -> list[str]:
    """Names of convolution / convolution_backward nodes left outside every delegate."""
    graph = compiled.edge.exported_program().graph
    names = ("convolution.default", "convolution_backward.default")
    return [
        n.name for n in graph.nodes if n.op == "call_function" and str(n.target).endswith(names)
    ]


@dataclasses.dataclass
class ProgramBytes:
    pte: int
    context: int
    compile_seconds: float
    on_cpu: list[str]


@dataclasses.dataclass
class Measurement:
    config: ConvConfig
    soc: str
    formulation: str
    weight_bytes: int
    programs: dict[str, ProgramBytes]
    stride_mode: str = "zero_insert"  # Options.stride
    forward_error: float | None = None  # fwd+bwd program on the simulator vs torch
    grad_input_error: float | None = None
    run_seconds: float | None = None  # one simulator execution of fwd+bwd

    @property
    def extra_bytes(self) -> int:
        """Context bytes the backward adds to the forward convolution."""
        return self.programs["fwd+bwd"].context - self.programs["fwd"].context

    @property
    def ratio(self) -> float:
        return self.extra_bytes / self.weight_bytes

    @property
    def all_delegated(self) -> bool:
        return not any(p.on_cpu for p in self.programs.values())


def lower(
    config: ConvConfig,
    program: str,
    soc: str,
    formulation: str,
    seed: int = 0,
    stride_mode: str = "zero_insert",
):
    """Compile one program with ``formulation`` and ``Options.stride=stride_mode``:
    (module, inputs, Compiled, seconds)."""
    from qnn_convbwd import api

    module, inputs, exported = export(config, program, seed)
    with api.enabled(input_gradient=formulation, stride=stride_mode):
        start = time.perf_counter()
        compiled = harness.lower_program(exported, soc)
        seconds = time.perf_counter() - start
    return module, inputs, compiled, seconds


def measure(
    config: ConvConfig,
    soc: str = "SM8650",
    formulation: str | None = None,
    *,
    run: bool = True,
    programs: tuple[str, ...] = PROGRAMS,
    seed: int = 0,
    stride_mode: str | None = None,
) -> Measurement:
    """Compile ``programs`` (and run fwd+bwd on the simulator when ``run``).

    ``formulation`` and ``stride_mode`` default to the defaults of
    ``Options.input_gradient`` and ``Options.stride``;
    ``extra_bytes`` and ``ratio`` need "fwd" and "fwd+bwd" among ``programs``.
    """
    from qnn_convbwd import options

    unknown = set(programs) - set(PROGRAMS)
    if unknown:
        raise ValueError(f"programs {sorted(unknown)} are not among {PROGRAMS}")
    formulation = formulation or options.Options().input_gradient
    stride_mode = stride_mode or options.Options().stride
    compiled_bytes: dict[str, ProgramBytes] = {}
    result = Measurement(
        config, soc, formulation, config.weight_bytes(), compiled_bytes, stride_mode
    )
    for program in PROGRAMS:
        if program not in programs:
            continue
        module, inputs, compiled, seconds = lower(
            config, program, soc, formulation, seed, stride_mode
        )
        compiled_bytes[program] = ProgramBytes(
            len(compiled.pte), compiled.context_binary_bytes, seconds, convolutions_on_cpu(compiled)
        )
        if program == "fwd+bwd" and run:
            start = time.perf_counter()
            outputs = compiled.run(inputs)
            result.run_seconds = time.perf_counter() - start
            forward, grad_input = reference(module, inputs)
            result.forward_error = (outputs[0] - forward).abs().max().item()
            result.grad_input_error = (outputs[1] - grad_input).abs().max().item()
    if {"fwd", "fwd+bwd"} <= set(programs):
        logger.info(
            "%s on %s with %s (stride %s): ratio %.3f (%d extra bytes for a %d-byte weight)",
            config,
            soc,
            formulation,
            stride_mode,
            result.ratio,
            result.extra_bytes,
            result.weight_bytes,
        )
    return result


TABLE_HEADER = (
    "| config | SoC | formulation | stride mode | weight B | pte fwd | pte fwd+bwd | pte bwd "
    "| ctx fwd | ctx fwd+bwd | ctx bwd | extra B | ratio | max err fwd | max err grad_input "
    "| compile s (fwd / fwd+bwd / bwd) | sim run s | all on HTP |"
)


def _err(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"


def table_row(m: Measurement) -> str:
    """One row of TABLE_HEADER; needs all three programs measured."""
    p = m.programs
    seconds = " / ".join(f"{p[k].compile_seconds:.1f}" for k in PROGRAMS)
    run = "-" if m.run_seconds is None else f"{m.run_seconds:.2f}"
    return (
        f"| {m.config} | {m.soc} (V{harness.SOC_ARCH.get(m.soc, '?')}) | {m.formulation} "
        f"| {m.stride_mode if m.config.stride > 1 else '-'} | {m.weight_bytes:,} "
        f"| {p['fwd'].pte:,} | {p['fwd+bwd'].pte:,} | {p['bwd'].pte:,} "
        f"| {p['fwd'].context:,} | {p['fwd+bwd'].context:,} | {p['bwd'].context:,} "
        f"| {m.extra_bytes:,} | {m.ratio:.3f} | {_err(m.forward_error)} "
        f"| {_err(m.grad_input_error)} | {seconds} | {run} | {'yes' if m.all_delegated else 'NO'} |"
    )


def to_markdown(measurements: list[Measurement]) -> str:
    separator = "|" + "---|" * TABLE_HEADER.count(" | ") + "---|"
    return "\n".join([TABLE_HEADER, separator, *(table_row(m) for m in measurements)])
