"""The frozen weight is stored once in the compiled program, and grad_input stays right.

The ratio tests compile the forward convolution alone and together with its
``convolution_backward`` and compare QNN context-binary bytes (see
``qnn_convbwd_dev.weight_bytes``). The numeric tests run the default formulation on
the x86-64 HTP simulator against ``F.conv2d`` and
``torch.ops.aten.convolution_backward``.
"""

from __future__ import annotations

import math

import pytest
import torch
from tiers import sweep
from torch import nn

from qnn_convbwd import options
from qnn_convbwd.builders import input_gradient_runtime_weight as rw
from qnn_convbwd.geometry import conv as geo
from qnn_convbwd_dev import weight_bytes as wb

# Measured with QAIRT 2.51 (x86-64 simulator), fp16, 256x256x3x3 weight (1,179,648
# bytes): the backward adds 12,288 context bytes with runtime_weight on V69, V75
# and V81 (ratio 0.010; the context grows in 4 KiB steps and the added ops take
# three of them), and 1,183,744-1,187,840 bytes (ratio 1.003-1.007) when it
# stores its own copy (transpose_conv). 0.05 is the goal for weights of 256 KiB
# and more: five times today's overhead, a twentieth of a second copy.
MAX_RATIO = 0.05
LARGE = wb.ConvConfig(256, 256, 3)
# Stride 2 on an odd size (output padding 0) : with TransposeConv2d's stride the
# HTP stores per-phase filters (ratio 0.101 runtime_weight, 1.785 transpose_conv,
# V69); upsampling grad_output with zeros (Options.stride="zero_insert") brings
# it to 0.010 (QAIRT 2.51, V69 and V81).
LARGE_STRIDE_2 = wb.ConvConfig(256, 256, 3, stride=2, size=15)


def test_config_parse_and_weight_bytes():
    config = wb.ConvConfig.parse("64x32x3:s2:g2:n15")
    assert config == wb.ConvConfig(64, 32, 3, stride=2, groups=2, size=15)
    assert config.weight_shape == (32, 32, 3, 3)
    assert config.weight_bytes() == 32 * 32 * 9 * 2
    dilated = wb.ConvConfig.parse("64x64x3:d2:n16")
    assert dilated == wb.ConvConfig(64, 64, 3, size=16, dilation=2)
    assert dilated.padding == 2 and str(dilated) == "64x64x3x3 d2 @16px"
    x, grad_output = wb.example_inputs(dilated)
    assert grad_output.shape == (1, 64, 16, 16)  # "same" padding at dilation 2
    with pytest.raises(ValueError):
        wb.ConvConfig.parse("64x32")


@pytest.mark.parametrize("numel", [1, 64, 65, 288, 2048, 147456, 9 * 256 * 255])
def test_stored_layout_splits_the_weight_without_padding(numel):
    head, tail = rw.stored_layout(numel)
    assert head + tail == numel  # every element stored once, nothing appended
    assert tail == min(rw.RUNTIME_TAIL, numel)


def test_default_is_runtime_weight():
    assert options.Options().input_gradient == rw.NAME


@pytest.fixture(scope="module", params=[LARGE, LARGE_STRIDE_2], ids=str)
def large_default(request, qnn_sdk):
    return wb.measure(request.param, "SM8650", programs=("fwd", "fwd+bwd"))


@pytest.mark.htp
def test_default_stores_a_large_weight_once(large_default):
    m = large_default
    assert m.all_delegated, {k: p.on_cpu for k, p in m.programs.items()}
    assert m.weight_bytes == 256 * 256 * 9 * 2
    assert m.ratio <= MAX_RATIO, (
        f"the backward adds {m.extra_bytes} context bytes to a {m.weight_bytes}-byte weight "
        f"(ratio {m.ratio:.3f} > {MAX_RATIO}): is the weight stored twice again?"
    )
    assert m.forward_error is not None and m.grad_input_error is not None
    assert m.forward_error < 5e-3 and m.grad_input_error < 5e-3


# --- numerics of runtime_weight -----------------------------------------------------------

# (c_in, c_out, kernel, stride, padding, groups, size, batch)
BANK = [
    (8, 16, 3, 1, 1, 1, 9, 1),  # odd size, weight padded to the raw block
    (8, 8, 3, 2, 1, 2, 9, 2),  # stride 2, groups 2, batch 2
    (16, 16, 3, 2, 1, 16, 10, 1),  # depthwise, stride 2 on an even size (output padding)
    (16, 32, 3, 1, 1, 16, 7, 1),  # depthwise with channel multiplier 2
    (6, 10, 5, 2, 2, 1, 11, 1),  # 5x5, stride 2, odd size
    (32, 64, 1, 1, 0, 1, 6, 1),  # 1x1, 2048 elements: no padding of the raw tensor
    (12, 20, 3, 2, 0, 1, 13, 1),  # no padding, stride 2, odd size
]


def _grad_input(conv: nn.Conv2d, x: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.convolution_backward(
        grad_output,
        x,
        conv.weight,
        None,
        list(conv.stride),
        list(conv.padding),
        list(conv.dilation),
        False,
        [0, 0],
        conv.groups,
        [True, False, False],
    )[0]


class _SharedWeights(nn.Module):
    """Each of ``convs``' forward conv and grad_input, on one shared frozen weight each."""

    def __init__(self, convs) -> None:
        super().__init__()
        self.convs = nn.ModuleList(convs)
        self.requires_grad_(False)

    def forward(self, *xs_and_grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outputs = []
        for i, conv in enumerate(self.convs):
            x, grad_output = xs_and_grads[2 * i], xs_and_grads[2 * i + 1]
            outputs += [conv(x), _grad_input(conv, x, grad_output)]
        return tuple(outputs)


class Bank(_SharedWeights):
    """Every BANK entry's forward conv and grad_input on one shared frozen weight each."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(
            nn.Conv2d(ci, co, k, stride=s, padding=p, groups=g) for ci, co, k, s, p, g, _, _ in BANK
        )


def _bank_inputs(bank: Bank) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    inputs = []
    for (ci, _, _, _, _, _, size, batch), conv in zip(BANK, bank.convs, strict=True):
        x = torch.randn(batch, ci, size, size, generator=gen)
        inputs += [x, torch.randn(conv(x).shape, generator=gen)]
    return inputs


@pytest.mark.htp
@pytest.mark.parametrize("soc", sweep(["SM8450"], ["SM8850"]))  # V69; V81 with --slow
def test_runtime_weight_matches_torch(qnn_sdk, soc):
    from qnn_convbwd import api
    from qnn_convbwd.toolchain import harness

    bank = Bank().eval()
    inputs = _bank_inputs(bank)
    program = torch.export.export(bank, tuple(inputs), strict=False)
    with api.enabled(input_gradient=rw.NAME):
        compiled = harness.lower_program(program, soc)
    assert compiled.report.delegated == len(BANK)
    assert wb.convolutions_on_cpu(compiled) == []
    _assert_matches_torch(compiled.run(inputs), bank, inputs, BANK, f"on {soc}")


def _assert_matches_torch(outputs, bank: _SharedWeights, inputs, configs, where: str) -> None:
    """Each conv's forward and grad_input within 5e-3 of its largest value (fp16)."""
    for i, conv in enumerate(bank.convs):
        x, grad_output = inputs[2 * i], inputs[2 * i + 1]
        for name, got, want in (
            ("forward", outputs[2 * i], conv(x)),
            ("grad_input", outputs[2 * i + 1], _grad_input(conv, x, grad_output)),
        ):
            torch.testing.assert_close(
                got,
                want,
                rtol=0,
                atol=5e-3 * want.abs().max().item() + 1e-6,
                msg=lambda text, cfg=configs[i], what=name: f"{what} of {cfg} {where}: {text}",
            )


# --- dilation: the dilated filter made in the graph from the one stored weight -------------

# (c_in, c_out, kernel, stride, padding, dilation, size)
DILATED = [
    (8, 16, 3, 1, 2, (2, 2), 9),
    (8, 8, 3, 2, 2, (2, 2), 11),  # stride 2 too
    (6, 12, 3, 1, (2, 1), (2, 1), 8),  # dilated in one dim
]


class DilatedBank(_SharedWeights):
    """Each DILATED entry's forward conv and grad_input on one shared frozen weight."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(
            nn.Conv2d(ci, co, k, stride=s, padding=p, dilation=d)
            for ci, co, k, s, p, d, _ in DILATED
        )


@pytest.mark.htp
def test_a_dilated_frozen_weight_is_stored_once_and_grad_input_matches_torch(qnn_sdk):
    """runtime_weight dilates the kernel in the graph (Reshape, zero insertion, slice) from
    the run-time HWIO the forward Conv2d reads: no static dilated copy, as for a trainable
    weight; before, a frozen dilated weight kept a second, dilated static filter."""
    from qnn_convbwd import api, integration
    from qnn_convbwd.toolchain import harness

    bank = DilatedBank().eval()
    gen = torch.Generator().manual_seed(1)
    inputs = []
    for (ci, *_, size), conv in zip(DILATED, bank.convs, strict=True):
        x = torch.randn(1, ci, size, size, generator=gen)
        inputs += [x, torch.randn(conv(x).shape, generator=gen)]
    program = torch.export.export(bank, tuple(inputs), strict=False)
    with api.enabled(input_gradient=rw.NAME), integration.capture_qnn_graphs() as graphs:
        compiled = harness.lower_program(program, "SM8650")
    assert compiled.report.delegated == len(DILATED)
    assert wb.convolutions_on_cpu(compiled) == []
    (ops,) = graphs
    convs = [op for op in ops if op.op_type == "Conv2d"]
    biases = {op.inputs[2].name for op in convs}
    assert len(convs) == len(DILATED) and all(
        op.inputs[1].kind == "QNN_TENSOR_TYPE_NATIVE" for op in convs
    )
    stored = {
        t.name: math.prod(t.dims)
        for op in ops
        for t in op.inputs
        if t.kind == "QNN_TENSOR_TYPE_STATIC" and t.name not in biases
    }
    # Each weight once, as the prelude's head and tail; nothing else is static.
    parts = sorted(n for conv in bank.convs for n in rw.stored_layout(conv.weight.numel()) if n)
    assert sorted(stored.values()) == parts, stored

    _assert_matches_torch(compiled.run(inputs), bank, inputs, DILATED, "on SM8650")


# --- structure: one stored tensor, read by both ops through the same wrapper -----------------


def _lower_captured(config: wb.ConvConfig, program: str):
    from qnn_convbwd import integration

    with integration.capture_qnn_graphs() as graphs:
        _, _, compiled, _ = wb.lower(config, program, "SM8650", rw.NAME)
    assert len(graphs) == 1
    return graphs[0], compiled


@pytest.mark.htp
@pytest.mark.parametrize(
    "config",
    [wb.ConvConfig(32, 48, 3), wb.ConvConfig(4, 4, 1, size=5)],  # 13,824 and 16 elements
    ids=str,
)
def test_forward_and_backward_read_one_runtime_weight(qnn_sdk, config):
    ops, compiled = _lower_captured(config, "fwd+bwd")
    assert wb.convolutions_on_cpu(compiled) == []
    by_type: dict[str, list] = {}
    for op in ops:
        by_type.setdefault(op.op_type, []).append(op)
    producers = {t.name: op for op in ops for t in op.outputs}
    (conv,) = by_type["Conv2d"]
    (tconv,) = by_type["TransposeConv2d"]

    conv_filter = conv.inputs[1]
    hwio_dims = tuple(config.weight_shape[i] for i in geo.OIHW_TO_HWIO)
    assert (conv_filter.kind, conv_filter.dims) == ("QNN_TENSOR_TYPE_NATIVE", hwio_dims)
    reshape = producers[conv_filter.name]
    assert reshape.op_type == "Reshape"
    # The backward's filter is the Transpose of the forward Conv2d's very filter tensor.
    transpose = producers[tconv.inputs[1].name]
    assert transpose.op_type == "Transpose"
    assert transpose.inputs[0].name == conv_filter.name

    # The weight is stored once, flat: the head, which Concat copies, and the last
    # RUNTIME_TAIL elements, which the Multiply by the run-time 1.0 reads (a weight
    # that small is all tail, with no Concat). The Reshape to HWIO is the filter.
    numel = math.prod(config.weight_shape)
    head, tail = rw.stored_layout(numel)
    (scale,) = by_type["ElementWiseMultiply"]
    assert (scale.inputs[0].kind, scale.inputs[0].dims) == ("QNN_TENSOR_TYPE_STATIC", (1, tail))
    assert math.prod(scale.inputs[1].dims) == 1  # the run-time 1.0
    parts = {scale.inputs[0].name: tail}
    readers = [scale.name]
    if head:
        (join,) = by_type["Concat"]
        assert reshape.inputs[0].name == join.outputs[0].name
        assert join.outputs[0].dims == (1, numel)
        stored, scaled = join.inputs
        assert (stored.kind, stored.dims) == ("QNN_TENSOR_TYPE_STATIC", (1, head))
        assert scaled.name == scale.outputs[0].name
        parts[stored.name] = head
        readers.append(join.name)
    else:
        assert "Concat" not in by_type
        assert reshape.inputs[0].name == scale.outputs[0].name
    bias = conv.inputs[2].name
    statics = {
        t.name: math.prod(t.dims)
        for op in ops
        for t in op.inputs
        if t.kind == "QNN_TENSOR_TYPE_STATIC" and t.name != bias
    }
    assert statics == parts
    reading = sorted(op.name for op in ops for t in op.inputs if t.name in statics)
    assert reading == sorted(readers)  # one op reads each


@pytest.mark.htp
def test_forward_alone_keeps_its_static_weight(qnn_sdk):
    """No convolution_backward reads the weight: nothing is added to the forward Conv2d."""
    config = wb.ConvConfig(32, 48, 3)
    ops, compiled = _lower_captured(config, "fwd")
    types = [op.op_type for op in ops]
    assert "ElementWiseMultiply" not in types and "Reshape" not in types
    (conv,) = [op for op in ops if op.op_type == "Conv2d"]
    assert conv.inputs[1].kind == "QNN_TENSOR_TYPE_STATIC"
    module, inputs, _ = wb.export(config, "fwd")
    (output,) = compiled.run(inputs)
    (want,) = wb.reference(module, inputs)
    torch.testing.assert_close(output, want, rtol=0, atol=5e-3 * want.abs().max().item())
