"""Programs that contain one ``aten.convolution_backward`` node, and the variant table.

``ConvConfig`` describes one convolution_backward call; ``build`` exports a
module whose forward calls the op directly (weight a frozen parameter, a buffer
or a graph input), so every argument the op accepts can be set, including ones
autograd never produces. ``CASES`` lists the variants the partitioner must
either lower or leave on CPU; ``tests/test_gates.py`` runs them and
``tests/test_property.py`` generates configurations with the same builder.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
from torch import nn

# --- one convolution_backward call ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ConvConfig:
    """Arguments of one convolution_backward call; per-dim tuples have one entry per dim."""

    in_channels: int = 4
    out_channels: int = 6
    kernel: tuple[int, ...] = (3, 3)
    input_size: tuple[int, ...] = (9, 9)
    stride: tuple[int, ...] = (1, 1)
    padding: tuple[int, ...] = (1, 1)
    dilation: tuple[int, ...] = (1, 1)
    groups: int = 1
    batch: int = 1
    output_mask: tuple[bool, bool, bool] = (True, False, False)
    transposed: bool = False
    output_padding: tuple[int, ...] | None = None  # the op's argument (transposed only)
    dtype: torch.dtype = torch.float32
    weight_as: str = "parameter"  # "parameter" (frozen), "buffer" or "input"
    # Overrides the grad_output size the forward convolution would produce (malformed graphs).
    grad_output_size: tuple[int, ...] | None = None

    @property
    def spatial_dims(self) -> int:
        return len(self.kernel)

    @property
    def weight_shape(self) -> tuple[int, ...]:
        if self.transposed:  # conv_transpose weight: [C_in, C_out / groups, *k]
            return (self.in_channels, self.out_channels // self.groups, *self.kernel)
        return (self.out_channels, self.in_channels // self.groups, *self.kernel)

    @property
    def op_output_padding(self) -> tuple[int, ...]:
        return self.output_padding or (0,) * self.spatial_dims

    def forward_output_size(self) -> tuple[int, ...]:
        """Spatial size of the forward convolution's output (= grad_output's)."""
        if self.grad_output_size is not None:
            return self.grad_output_size
        dims = zip(
            self.input_size,
            self.kernel,
            self.stride,
            self.padding,
            self.dilation,
            self.op_output_padding,
        )
        if self.transposed:
            return tuple((i - 1) * s - 2 * p + d * (k - 1) + op + 1 for i, k, s, p, d, op in dims)
        return tuple((i + 2 * p - d * (k - 1) - 1) // s + 1 for i, k, s, p, d, _ in dims)

    def args(self) -> tuple:
        """The arguments after (grad_output, input, weight), in schema order."""
        bias_sizes = [self.out_channels] if self.output_mask[2] else None
        return (
            bias_sizes,
            list(self.stride),
            list(self.padding),
            list(self.dilation),
            self.transposed,
            list(self.op_output_padding),
            self.groups,
            list(self.output_mask),
        )

    def describe(self) -> str:
        return (
            f"{self.spatial_dims}-D in={self.batch}x{self.in_channels}x{self.input_size} "
            f"out_ch={self.out_channels} k={self.kernel} s={self.stride} p={self.padding} "
            f"d={self.dilation} g={self.groups} mask={self.output_mask}"
            + (" transposed" if self.transposed else "")
            + ("" if self.dtype == torch.float32 else f" {self.dtype}")
            + ("" if self.weight_as == "parameter" else f" weight={self.weight_as}")
        )


class ConvBackwardModule(nn.Module):
    """``forward(grad_output, input[, weight])`` returns the gradients the op computes."""

    def __init__(self, config: ConvConfig, weight: torch.Tensor) -> None:
        super().__init__()
        self.config = config
        if config.weight_as == "parameter":
            self.weight = nn.Parameter(weight, requires_grad=False)
        elif config.weight_as == "buffer":
            self.register_buffer("weight", weight)
        elif config.weight_as == "input":
            self.weight = None
        else:
            raise ValueError(f"weight_as={config.weight_as!r}")

    def forward(self, grad_output: torch.Tensor, input: torch.Tensor, *weight: torch.Tensor):
        w = weight[0] if self.weight is None else self.weight
        outs = torch.ops.aten.convolution_backward.default(
            grad_output, input, w, *self.config.args()
        )
        # By output_mask, not "is not None": eager grouped kernels return grad_weight unasked.
        return tuple(o for o, asked in zip(outs, self.config.output_mask) if asked)

    def magnitude(self, grad_output: torch.Tensor, input: torch.Tensor, *weight: torch.Tensor):
        """The outputs computed from absolute values: per element, the sum of |terms|.

        Bounds the rounding error of a reduced-precision computation elementwise.
        """
        w = weight[0] if self.weight is None else self.weight
        outs = torch.ops.aten.convolution_backward.default(
            grad_output.abs(), input.abs(), w.abs(), *self.config.args()
        )
        return tuple(o for o, asked in zip(outs, self.config.output_mask) if asked)


@dataclasses.dataclass
class Built:
    config: ConvConfig
    module: ConvBackwardModule
    program: torch.export.ExportedProgram
    inputs: tuple[torch.Tensor, ...]
    # Further inputs the program accepts (other sizes of a dynamic dim).
    more_inputs: list[tuple[torch.Tensor, ...]] = dataclasses.field(default_factory=list)

    def expected(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        with torch.no_grad():
            return list(self.module(*inputs))

    def magnitude(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        with torch.no_grad():
            return list(self.module.magnitude(*inputs))


def make_inputs(config: ConvConfig, generator: torch.Generator, batch: int | None = None):
    """(grad_output, input) for ``config``; grad_output has C_out channels either way."""
    batch = config.batch if batch is None else batch
    size = config.forward_output_size()
    grad_output = torch.randn(batch, config.out_channels, *size, generator=generator)
    x = torch.randn(batch, config.in_channels, *config.input_size, generator=generator)
    return grad_output.to(config.dtype), x.to(config.dtype)


def build(config: ConvConfig, seed: int = 0, dynamic_batch: tuple[int, int] | None = None) -> Built:
    """Export a module calling convolution_backward with ``config``.

    ``dynamic_batch=(lo, hi)`` exports the batch dim as ``torch.export.Dim``.
    """
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(*config.weight_shape, generator=generator)
    # Keep values ~1 whatever the fan-in, so tolerances mean the same everywhere.
    weight = (weight / math.sqrt(math.prod(config.weight_shape[1:]))).to(config.dtype)
    module = ConvBackwardModule(config, weight).eval()
    grad_output, x = make_inputs(config, generator)
    inputs: tuple[torch.Tensor, ...] = (grad_output, x)
    if config.weight_as == "input":
        inputs = (*inputs, weight.clone())
    dynamic_shapes = None
    more: list[tuple[torch.Tensor, ...]] = []
    if dynamic_batch is not None:
        lo, hi = dynamic_batch
        batch = torch.export.Dim("batch", min=lo, max=hi)
        dynamic_shapes = [{0: batch}, {0: batch}] + [None] * (len(inputs) - 2)
        for b in sorted({lo, hi} - {config.batch}):
            more.append((*make_inputs(config, generator, batch=b), *inputs[2:]))
    program = torch.export.export(module, inputs, dynamic_shapes=dynamic_shapes, strict=False)
    return Built(config, module, program, inputs, more)


def conv_backward_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """convolution_backward nodes of ``graph`` in any dialect (aten, edge, out variant)."""
    return [
        n
        for n in graph.nodes
        if n.op == "call_function" and "convolution_backward" in str(n.target)
    ]


# --- tolerances ---------------------------------------------------------------------

# HTP runs these graphs in fp16: inputs are rounded to 11 significant bits and
# products accumulated; 2**-7 of the sum of |terms| leaves room for a few
# roundings per term and is far below the error of any wrong parameter (which
# moves whole terms).
FP16_RTOL = 2.0**-7


def cpu_rtol(config: ConvConfig) -> float:
    """Bound for executorch's CPU kernel against torch, relative to the magnitude.

    The portable kernel accumulates in the operand dtype: recursive summation of
    n terms errs by at most about n * eps of the sum of |terms|; torch's own
    result may err as much again.
    """
    out_size = math.prod(config.forward_output_size())
    terms = max(
        (config.out_channels // config.groups) * math.prod(config.kernel),  # grad_input
        config.batch * out_size,  # grad_weight, grad_bias
    )
    return 2 * terms * torch.finfo(config.dtype).eps


def worst_ratio(
    actual: torch.Tensor, expected: torch.Tensor, magnitude: torch.Tensor, atol: float = 1e-6
) -> float:
    """max over elements of |actual - expected| / (magnitude + atol)."""
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = (actual.double() - expected.double()).abs()
    return float((err / (magnitude.double().abs() + atol)).max()) if err.numel() else 0.0


def assert_matches(
    actual: Sequence[torch.Tensor],
    expected: Sequence[torch.Tensor],
    magnitude: Sequence[torch.Tensor],
    rtol: float,
    what: str = "",
) -> float:
    """Elementwise |actual - expected| <= rtol * magnitude; returns the worst ratio / rtol."""
    assert len(actual) == len(expected), f"{what}: {len(actual)} outputs, expected {len(expected)}"
    worst = 0.0
    for i, (a, e, m) in enumerate(zip(actual, expected, magnitude)):
        assert a.dtype == e.dtype, f"{what}: output {i} dtype {a.dtype} != {e.dtype}"
        ratio = worst_ratio(a, e, m)
        assert ratio <= rtol, (
            f"{what}: output {i} differs by {ratio:.3g} x magnitude (allowed {rtol:.3g}); "
            f"max abs error {float((a.double() - e.double()).abs().max()):.3g}"
        )
        worst = max(worst, ratio / rtol)
    return worst


# --- the variant table -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One variant of convolution_backward the partitioner has to handle.

    ``needs``: the capabilities (``partition.support.CAPABILITIES``) that make it
    delegable; ``None`` when no capability lifts ``rule`` (a limit of the
    target, of the graph or of TransposeConv). ``rule``: the rule that rejects
    it while it is not delegable.
    """

    name: str
    config: ConvConfig
    rule: str | None
    needs: frozenset[str] | None
    dynamic_batch: tuple[int, int] | None = None
    # What executorch's portable convolution_backward kernel logs when it refuses
    # the node at run time (it computes 2-D, non-transposed convolutions only; the
    # plugin lifts 1-D nodes that stay on CPU to 2-D, so only transposed and 3-D
    # nodes are refused).
    cpu_kernel_refuses: str | None = None
    # torch itself refuses these shapes; the CPU kernel must refuse them too.
    torch_rejects: bool = False

    def supported(self, capabilities: frozenset[str]) -> bool:
        return self.needs is not None and self.needs <= capabilities

    def build(self, seed: int = 0) -> Built:
        return build(self.config, seed, self.dynamic_batch)


_2D = frozenset({"grad_input", "conv2d"})
# executorch 1.5.1 kernels/portable/cpu/op_convolution_backward.cpp
_NO_TRANSPOSED = "Transposed Convolution Backward not supported yet"
_ONLY_2D = "Only 2D Convolution Backward supported for now"
_BASE = ConvConfig()
_1D = dataclasses.replace(
    _BASE, kernel=(3,), input_size=(11,), stride=(2,), padding=(1,), dilation=(1,)
)

CASES: tuple[Case, ...] = (
    # Delegated today: show the table's "supported" branch works.
    Case("plain", _BASE, None, _2D),
    Case(
        "strided_odd_buffer_weight",
        dataclasses.replace(_BASE, stride=(2, 2), input_size=(9, 8), weight_as="buffer"),
        None,
        _2D,
    ),
    # What is asked of the op.
    Case(
        "grad_weight",
        dataclasses.replace(_BASE, output_mask=(True, True, False)),
        "requested_gradients",
        _2D | {"grad_weight"},
    ),
    Case(
        "grad_bias",
        dataclasses.replace(_BASE, output_mask=(True, False, True)),
        "requested_gradients",
        _2D | {"grad_bias"},
    ),
    Case(
        "grad_weight_only",
        dataclasses.replace(_BASE, output_mask=(False, True, False)),
        "requested_gradients",
        frozenset({"grad_weight", "conv2d"}),
    ),
    Case(
        "dilation",
        dataclasses.replace(_BASE, dilation=(2, 1), input_size=(11, 9)),
        "dilation",
        _2D | {"dilation"},
    ),
    Case(
        "transposed",
        dataclasses.replace(_BASE, transposed=True, stride=(2, 2), output_padding=(1, 0)),
        "not_transposed",
        None,
        cpu_kernel_refuses=_NO_TRANSPOSED,
    ),
    Case("conv1d", _1D, "spatial_dims", frozenset({"grad_input", "conv1d"})),
    Case(
        "conv3d",
        dataclasses.replace(
            _BASE,
            kernel=(3, 3, 3),
            input_size=(5, 6, 5),
            stride=(1, 2, 2),
            padding=(1, 1, 1),
            dilation=(1, 1, 1),
        ),
        "spatial_dims",
        frozenset({"grad_input", "conv3d"}),
        cpu_kernel_refuses=_ONLY_2D,
    ),
    # A TransposeConv3d defect (see the rule): H != W strides are lowered with the
    # spatial dims reordered, three different strides cannot be. No capability
    # lifts it, and the CPU kernel cannot run a 3-D node: the program fails loudly.
    Case(
        "conv3d_three_strides",
        dataclasses.replace(
            _BASE,
            kernel=(3, 3, 3),
            input_size=(5, 7, 7),
            stride=(1, 2, 3),
            padding=(1, 1, 1),
            dilation=(1, 1, 1),
        ),
        "transpose_conv3d_strides",
        None,
        cpu_kernel_refuses=_ONLY_2D,
    ),
    # Operands.
    # A weight the program reads at run time (a graph input here; a trainable
    # parameter in a joint graph) reaches grad_input through a Transpose...
    Case("weight_input", dataclasses.replace(_BASE, weight_as="input"), None, _2D),
    # ...dilated with zeros inserted in the graph...
    Case(
        "dilated_weight_input",
        dataclasses.replace(_BASE, dilation=(2, 2), padding=(2, 2), weight_as="input"),
        None,
        _2D | {"dilation"},
    ),
    # ...but a grouped 3-D node's block-diagonal filter is built from the weight's values.
    Case(
        "conv3d_grouped_weight_input",
        dataclasses.replace(
            _BASE,
            in_channels=4,
            out_channels=4,
            groups=2,
            kernel=(3, 3, 3),
            input_size=(5, 6, 5),
            stride=(1, 1, 1),
            padding=(1, 1, 1),
            dilation=(1, 1, 1),
            weight_as="input",
        ),
        "weight_values",
        None,
        cpu_kernel_refuses=_ONLY_2D,
    ),
    Case("float16", dataclasses.replace(_BASE, dtype=torch.float16), None, _2D),
    Case("float64", dataclasses.replace(_BASE, dtype=torch.float64), "float_operands", None),
    Case("bfloat16", dataclasses.replace(_BASE, dtype=torch.bfloat16), "float_operands", None),
    # 1-D nodes the rules keep on CPU: lifted to 2-D for executorch's CPU kernel.
    Case(
        "conv1d_float64_all_gradients",
        dataclasses.replace(
            _1D,
            out_channels=8,
            input_size=(13,),
            padding=(2,),
            dilation=(2,),
            groups=2,
            batch=2,
            output_mask=(True, True, True),
            dtype=torch.float64,
        ),
        "float_operands",
        None,
    ),
    Case(
        "conv1d_weight_input",
        dataclasses.replace(_1D, output_mask=(True, True, False), weight_as="input"),
        None,
        frozenset({"grad_input", "grad_weight", "conv1d"}),
    ),
    Case(
        "conv1d_transposed",
        dataclasses.replace(_1D, transposed=True, output_padding=(1,)),
        "not_transposed",
        None,
        cpu_kernel_refuses=_NO_TRANSPOSED,
    ),
    # Graph shapes.
    Case(
        "dynamic_batch",
        dataclasses.replace(_BASE, batch=2),
        "static_shapes",
        None,
        dynamic_batch=(1, 4),
    ),
    # Depthwise grad_weight with batch 1, a 1x1 grad_output and a unit padded input
    # dim: its former 5-D Transpose failed to compile (q::ForceFormat_Crouton,
    # QAIRT 2.51); builders/weight_gradient.py has a 4-D path for depthwise now.
    Case(
        "depthwise_grad_weight_1x1",
        dataclasses.replace(
            _BASE,
            in_channels=2,
            out_channels=2,
            groups=2,
            kernel=(1, 2),
            input_size=(1, 2),
            padding=(0, 0),
            output_mask=(True, True, False),
        ),
        "requested_gradients",
        _2D | {"grad_weight"},
    ),
    # grad_output 8x8 from a 10x10 input with stride 1: no forward convolution
    # produces that, and TransposeConv would need output_padding 2 >= stride.
    Case(
        "inexpressible_output_padding",
        dataclasses.replace(_BASE, input_size=(10, 10), grad_output_size=(8, 8)),
        "expressible_output_padding",
        None,
        cpu_kernel_refuses="tensor_has_expected_size(grad_output",
        torch_rejects=True,
    ),
)

CASE_BY_NAME: dict[str, Case] = {c.name: c for c in CASES}


def case_ids(cases: Sequence[Case]) -> list[str]:
    return [c.name for c in cases]


# --- executorch's QNN flow up to its partitioner ----------------------------------------


def qnn_edge(program: torch.export.ExportedProgram, specs: list) -> torch.export.ExportedProgram:
    """``program`` through executorch's QNN export and to_edge passes (the plugin's among
    them when it is enabled): the edge program its partitioner sees."""
    from executorch.backends.qualcomm._passes.qnn_pass_manager import QnnPassManager
    from executorch.backends.qualcomm.utils.utils import qnn_edge_config
    from executorch.exir import to_edge_transform_and_lower

    passes = QnnPassManager()
    aten = passes.transform_for_export_pipeline(program)
    return to_edge_transform_and_lower(
        aten,
        transform_passes=passes.get_to_edge_transform_passes(aten, compiler_specs=specs),
        compile_config=qnn_edge_config(),
    ).exported_program()
