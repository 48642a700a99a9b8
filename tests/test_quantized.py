"""Quantization gate: a convolution_backward with quantized activations stays on CPU.

The lowering builds float TransposeConv2d only. Quantized operands are recognised
by executorch's quantization metadata (``QCOM_QUANT_ATTRS``, which
AnnotateQuantAttrs writes and FoldQDQ keeps when it removes the Q/DQ nodes), and by
a dequantize producer in graphs that have not been through FoldQDQ. A frozen
quantized weight is the exception: grad_input reads it dequantized in the graph.
"""

from __future__ import annotations

import logging

import cases
import pytest
import torch
import torchao.quantization.pt2e  # noqa: F401  registers torch.ops.quantized_decomposed
from torch import nn

from qnn_convbwd.partition import support, verdict
from qnn_convbwd.partition.target import Target

SOC = "SM8650"
CONV = dict(stride=[1, 1], padding=[1, 1], dilation=[1, 1])


def _conv_bwd(grad_output, x, weight):
    return torch.ops.aten.convolution_backward.default(
        grad_output, x, weight, None, CONV["stride"], CONV["padding"], CONV["dilation"],
        False, [0, 0], 1, [True, False, False],
    )[0]  # fmt: skip


class Saliency(nn.Module):
    """Input gradient of a frozen conv + relu layer for an upstream gradient of relu(y)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 6, 3, padding=1, bias=False)
        self.conv.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor):
        g = torch.relu(self.conv(x))
        return _conv_bwd(g, x, self.conv.weight), g


def _quantized_saliency(seed: int = 0):
    """(float module, pt2e-converted module, exported quantized program, inputs)."""
    from executorch.backends.qualcomm.quantizer.quantizer import QnnQuantizer
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    torch.manual_seed(seed)
    model = Saliency().eval()
    x = torch.randn(1, 4, 8, 8)
    prepared = prepare_pt2e(torch.export.export(model, (x,), strict=True).module(), QnnQuantizer())
    for _ in range(4):
        prepared(torch.randn(1, 4, 8, 8))
    prepared(x)
    converted = convert_pt2e(prepared)
    return model, converted, torch.export.export(converted, (x,), strict=True), (x,)


def _qparams(node: torch.fx.Node) -> tuple[float, int]:
    """(scale, zero_point) of a quantize/dequantize_per_tensor node."""
    return float(node.args[1]), int(node.args[2])


def _not_delegated(caplog) -> list[logging.LogRecord]:
    """The convolution_backward rejections (every op's rejection carries its rule)."""
    return [
        r
        for r in caplog.records
        if hasattr(r, "convbwd_rule") and r.getMessage().startswith("convolution_backward ")
    ]


@pytest.mark.htp
def test_pt2e_quantized_program_falls_back_with_right_numbers(qnn_sdk, caplog):
    from qnn_convbwd.toolchain import harness

    model, converted, program, inputs = _quantized_saliency()
    (node,) = cases.conv_backward_nodes(program.graph)
    dq_grad_output = node.args[0]
    assert "dequantize" in str(dq_grad_output.target), "the quantizer left grad_output float"
    grad_scale, _ = _qparams(dq_grad_output)
    (q_out,) = [u for u in next(iter(node.users)).users if "quantize" in str(u.target)]
    out_scale, _ = _qparams(q_out)

    caplog.set_level(logging.INFO, logger="qnn_convbwd")
    compiled = harness.lower_program(program, SOC, fp16=False)

    (row,) = compiled.report.rows
    assert not row.delegated
    assert "QCOM_QUANT_ATTRS" in row.reason, row.reason
    assert [r.convbwd_rule for r in _not_delegated(caplog)] == ["not_quantized"]
    top = cases.conv_backward_nodes(compiled.edge.exported_program().graph)
    assert len(top) == 1, "convolution_backward left the top-level graph"
    # The quantized conv + relu still went to HTP.
    assert harness.delegate_count(compiled.edge) == 1

    grad, g = compiled.run(inputs)
    weight = model.conv.weight.detach()
    # 1. The CPU node computes torch's input gradient of the tensor it was given.
    with torch.no_grad():
        expected = _conv_bwd(g, inputs[0], weight)
        magnitude = _conv_bwd(g.abs(), inputs[0], weight.abs())
    cases.assert_matches([grad], [expected], [magnitude], 1e-5, "CPU convolution_backward")

    # 2. Against the quantized reference (the converted module run eagerly): HTP
    # and the reference may round grad_output one step apart, which moves each
    # element of grad_input by at most one step times the sum of |w| it reads;
    # the reference also rounds its output (FoldQDQ removed that Q/DQ pair from
    # the lowered program), half an output step.
    with torch.no_grad():
        ref_grad, ref_g = converted(*inputs)
        one_step = _conv_bwd(torch.full_like(g, grad_scale), inputs[0], weight.abs())
    assert (g - ref_g).abs().max() <= grad_scale * 1.001, "grad_output more than a step off"
    excess = (grad - ref_grad).abs() - (one_step + out_scale / 2)
    assert excess.max() <= 1e-6, f"grad_input exceeds the quantization bound by {excess.max()}"
    # ... and the quantization error is what it is: the float model is further away.
    with torch.no_grad():
        float_grad, _ = model(*inputs)
    assert (grad - float_grad).abs().max() > 0


class Saliency1d(nn.Module):
    """``Saliency`` with a Conv1d: its convolution_backward is 1-D."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 6, 3, padding=1, bias=False)
        self.conv.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor):
        g = torch.relu(self.conv(x))
        return _conv_bwd_1d(g, x, self.conv.weight), g


def _conv_bwd_1d(grad_output, x, weight):
    return torch.ops.aten.convolution_backward.default(
        grad_output, x, weight, None, [1], [1], [1], False, [0], 1, [True, False, False]
    )[0]


@pytest.mark.htp
def test_pt2e_quantized_1d_program_runs_its_node_on_cpu_as_2d(qnn_sdk, caplog):
    """The quantization gate keeps the 1-D node on CPU; the transform pass lifts it to
    2-D there, reading the frozen weight through a view, so executorch's kernel runs it."""
    from executorch.backends.qualcomm.quantizer.quantizer import QnnQuantizer
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    from qnn_convbwd.toolchain import harness

    torch.manual_seed(0)
    model = Saliency1d().eval()
    x = torch.randn(1, 4, 16)
    prepared = prepare_pt2e(torch.export.export(model, (x,), strict=True).module(), QnnQuantizer())
    for _ in range(4):
        prepared(torch.randn(1, 4, 16))
    prepared(x)
    program = torch.export.export(convert_pt2e(prepared), (x,), strict=True)

    caplog.set_level(logging.INFO, logger="qnn_convbwd")
    compiled = harness.lower_program(program, SOC, fp16=False)
    (row,) = compiled.report.rows
    assert not row.delegated and "QCOM_QUANT_ATTRS" in row.reason, row.reason
    assert row.cpu_refusal is None
    assert [r.convbwd_rule for r in _not_delegated(caplog)] == ["not_quantized"]
    (node,) = cases.conv_backward_nodes(compiled.edge.exported_program().graph)
    assert node.args[0].meta["val"].dim() == 4 and list(node.args[4]) == [1, 1]
    assert harness.delegate_count(compiled.edge) == 1  # the quantized conv + relu

    grad, g = compiled.run((x,))
    weight = model.conv.weight.detach()
    with torch.no_grad():
        expected = _conv_bwd_1d(g, x, weight)
        magnitude = _conv_bwd_1d(g.abs(), x, weight.abs())
    cases.assert_matches([grad], [expected], [magnitude], 1e-5, "lifted CPU convolution_backward")


class DequantizedWeight(nn.Module):
    """convolution_backward reading an int8 weight through dequantize_per_tensor."""

    SCALE = 0.02

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        q = torch.clamp(torch.round(weight / self.SCALE), -127, 127).to(torch.int8)
        self.register_buffer("weight_q", q)

    def weight(self) -> torch.Tensor:
        return torch.ops.quantized_decomposed.dequantize_per_tensor.default(
            self.weight_q, self.SCALE, 0, -127, 127, torch.int8
        )

    def forward(self, grad_output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return _conv_bwd(grad_output, x, self.weight())


def _dequantized_weight_program():
    torch.manual_seed(1)
    model = DequantizedWeight(torch.randn(6, 4, 3, 3) * 0.5).eval()
    x = torch.randn(1, 4, 8, 8)
    grad_output = torch.randn(1, 6, 8, 8)
    program = torch.export.export(model, (grad_output, x), strict=True)
    return model, program, (grad_output, x)


def _partition_check(program, specs, caplog) -> tuple[torch.fx.Node, bool]:
    """executorch's QNN to_edge passes, then its (patched) support check on the node."""
    from executorch.backends.qualcomm.partition.qnn_partitioner import QnnOperatorSupport
    from executorch.backends.qualcomm.utils.qnn_manager_lifecycle import QnnManagerContext

    edge = cases.qnn_edge(program, specs)
    (node,) = cases.conv_backward_nodes(edge.graph)
    caplog.set_level(logging.INFO, logger="qnn_convbwd")
    with QnnManagerContext({"forward": specs}):
        checker = QnnOperatorSupport(edge, specs, set(), set())
        return node, checker.is_node_supported(None, node)


@pytest.mark.htp
def test_quantized_weight_is_supported_for_grad_input(qnn_sdk, plugin, caplog):
    """FoldQDQ keeps a parameter's dequantize; the metadata sits on the int8 buffer, and
    grad_input of a frozen quantized weight is delegated (the weight dequantized in the
    graph, builders/weights.py)."""
    from qnn_convbwd.toolchain import harness

    _, program, _ = _dequantized_weight_program()
    node, supported = _partition_check(program, harness.compile_specs(SOC, fp16=False), caplog)
    weight = node.args[2]  # schema: grad_output, input, weight
    assert "dequantize" in str(weight.target), "expected the weight's dequantize to stay"
    assert weight.args[0].meta.get(support.integration.get("QCOM_QUANT_ATTRS"))
    assert supported is True, [r.getMessage() for r in _not_delegated(caplog)]


@pytest.mark.htp
def test_dequantized_weight_grad_input_runs_on_the_htp(qnn_sdk, caplog):
    """The weight's dequantize and the convolution_backward are one delegate; grad_input
    equals torch's with the dequantized weight. With fp32 specs the path is not fp32-exact
    (measured 4.6e-4 x magnitude), so the bound is fp16's epsilon, 1e-3."""
    from qnn_convbwd.toolchain import harness

    model, program, inputs = _dequantized_weight_program()
    compiled = harness.lower_program(program, SOC, fp16=False)
    (row,) = compiled.report.rows
    assert row.delegated, row.reason
    assert harness.delegate_count(compiled.edge) == 1
    (grad,) = compiled.run(inputs)
    with torch.no_grad():
        expected = model(*inputs)
        magnitude = _conv_bwd(inputs[0].abs(), inputs[1], model.weight().abs())
    cases.assert_matches([grad], [expected], [magnitude], 1e-3, "quantized weight on the HTP")


def _decide_on_plain_edge(program) -> verdict.Decision:
    """decide() on a graph that has not been through executorch's QNN passes."""
    from executorch.exir import to_edge

    edge = to_edge(program).exported_program()
    (node,) = cases.conv_backward_nodes(edge.graph)
    key = support.integration.get("QCOM_QUANT_ATTRS")
    assert not any(key in n.meta for n in edge.graph.nodes), "metadata already present"
    target = Target(backend="htp", soc=SOC, htp_arch=75, saver=False, edge_program=edge)
    return support.decide(node, target, log=False)


@pytest.mark.htp  # executorch's QnnQuantizer reads the QAIRT version from the SDK's libraries
def test_dequantize_producer_is_the_second_line():
    """Without QCOM_QUANT_ATTRS (no AnnotateQuantAttrs ran), a dequantize producer still tells."""
    _, _, program, _ = _quantized_saliency()
    decision = _decide_on_plain_edge(program)
    assert decision.rejection is not None and decision.rejection.rule == "not_quantized"
    assert decision.rejection.values.startswith("grad_output=")
    assert "produced by a dequantize" in decision.rejection.values

    _, program, _ = _dequantized_weight_program()
    decision = _decide_on_plain_edge(program)
    assert decision.rejection is not None and decision.rejection.rule == "not_quantized"
    assert decision.rejection.values.startswith("weight=")
    assert "produced by a dequantize" in decision.rejection.values
