"""GELU in training graphs: the erf of its backward as ops the HTP runs (passes/erf.py).

The rewrite's function is measured in torch's own fp16 ops (each op rounded as the
HTP's fp16 ops round) against the exact erf, and in fp32 against ``torch.erf``; the
simulator runs GELU's forward (QNN's Gelu) and backward, both the erf and the tanh
form, next to torch fp32 and fp16.
"""

from __future__ import annotations

import logging
import math

import cases
import torch
from executorch.exir import to_edge
from torch import nn

import qnn_convbwd
from qnn_convbwd import training
from qnn_convbwd.passes import erf


def _ulps(x: torch.Tensor) -> torch.Tensor:
    """One fp16 unit in the last place at |x| (normal range; 2^-24 below)."""
    exponent = torch.floor(torch.log2(x.abs().clamp_min(2.0**-14)))
    return 2.0 ** (exponent - 10)


def test_erf_in_fp16_ops_is_within_about_two_ulps_and_in_fp32_within_2e_6():
    x = torch.linspace(-6, 6, 120001, dtype=torch.float64)
    half = x.half()
    exact = torch.erf(half.double())  # of the fp16 inputs
    ours = erf.erf_reference(half).double()
    torchs = torch.erf(half).double()
    assert (ours - exact).abs().div(_ulps(exact)).max() <= 2.5
    # On average not far from torch's own fp16 erf, and unbiased.
    assert (ours - exact).abs().mean() <= 1.6 * (torchs - exact).abs().mean()
    assert abs((ours - exact).mean()) <= 1e-6
    assert (erf.erf_reference(x.float()).double() - torch.erf(x)).abs().max() <= 2e-6
    assert erf.erf_reference(torch.zeros(1, dtype=torch.float16)).item() == 0.0


class _Erf(nn.Module):
    def forward(self, x):
        return torch.erf(x)


def test_rewrite_leaves_no_erf_and_computes_the_same_on_cpu():
    x = torch.linspace(-4, 4, 801).reshape(1, 801)
    with qnn_convbwd.enabled():
        program = to_edge(torch.export.export(_Erf(), (x,))).exported_program()
    module = program.graph_module
    assert erf.rewrite_erfs(module) == 1
    calls = [n.target.__name__ for n in module.graph.nodes if n.op == "call_function"]
    assert not any("erf" in call for call in calls)
    assert "aten.where.self" in calls
    # t = 1 / (1 + p|x|) as a division: the HTP takes no float reciprocal.
    assert "aten.div.Tensor" in calls and "aten.reciprocal.default" not in calls
    (out,) = module(x)
    assert (out - torch.erf(x)).abs().max() <= 2e-6
    assert torch.equal(out, erf.erf_reference(x))


def _qnn_support(program: torch.export.ExportedProgram, specs: list):
    """executorch's QNN to_edge passes (the plugin's among them when it is enabled) on
    ``program``, then the edge program and its (patched) per-node support check, which
    asks QNN's op validation; call it inside ``QnnManagerContext``."""
    from executorch.backends.qualcomm.partition.qnn_partitioner import QnnOperatorSupport

    edge = cases.qnn_edge(program, specs)
    return edge, QnnOperatorSupport(edge, specs, set(), set())


# The tensor of ConvNeXt-Tiny's first GELU at 32 px (batch 2): a Linear's output, NHWC.
CONVNEXT_GELU = (2, 8, 8, 384)


def test_every_op_of_the_rewrite_passes_qnn_validation_in_fp16(qnn_sdk, plugin):
    """Each node of the rewritten erf, on the tensor ConvNeXt's GELU backward reads, is
    taken by QNN's op validation for SM8650 (nothing compiled)."""
    from executorch.backends.qualcomm.utils.qnn_manager_lifecycle import QnnManagerContext

    from qnn_convbwd.toolchain import harness

    specs = harness.compile_specs("SM8650")
    x = torch.randn(CONVNEXT_GELU)
    program = torch.export.export(_Erf(), (x,))
    with QnnManagerContext({"forward": specs}):
        edge, checker = _qnn_support(program, specs)
        calls = [n for n in edge.graph.nodes if n.op == "call_function"]
        rejected = [n.name for n in calls if not checker.is_node_supported(None, n)]
    assert rejected == []
    targets = {n.target.__name__ for n in calls}
    assert "aten.where.self" in targets and not any("erf" in t for t in targets)


class _Reciprocal(nn.Module):
    def forward(self, x):
        return torch.reciprocal(x)


def test_qnn_validation_rejects_a_float_reciprocal(qnn_sdk, plugin, caplog):
    """Why the rewrite divides: QNN's ElementWiseUnary (executorch's reciprocal visitor)
    takes no float operand on the HTP ("operation 'Reciprocal' does not support FLOAT16
    or FLOAT32 datatype", QAIRT 2.51). Should QAIRT take it, this fails, and the
    division could go back to a reciprocal."""
    from executorch.backends.qualcomm.partition.qnn_partitioner import QnnOperatorSupport
    from executorch.backends.qualcomm.utils.qnn_manager_lifecycle import QnnManagerContext

    from qnn_convbwd.toolchain import harness

    specs = harness.compile_specs("SM8650")
    edge = to_edge(torch.export.export(_Reciprocal(), (torch.rand(CONVNEXT_GELU) + 1,)))
    program = edge.exported_program()
    (node,) = [n for n in program.graph.nodes if "reciprocal" in str(n.target)]
    caplog.set_level(logging.INFO, logger="qnn_convbwd")
    with QnnManagerContext({"forward": specs}):
        checker = QnnOperatorSupport(program, specs, set(), set())
        assert checker.is_node_supported(None, node) is False
    verdicts = [r for r in caplog.records if node.name in r.getMessage()]
    assert [getattr(r, "convbwd_rule", None) for r in verdicts] == ["backend_validation"]


class _Gelus(nn.Module):
    """Both GELUs between convolutions, and ConvNeXt's block MLP (Linear, GELU, Linear on
    channels-last maps between permutes), trained."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3)
        self.conv2 = nn.Conv2d(8, 8, 3)
        self.expand = nn.Linear(8, 32)
        self.project = nn.Linear(32, 8)
        self.head = nn.Linear(8 * 4 * 4, 5)

    def forward(self, x):
        x = nn.functional.gelu(self.conv1(x))
        x = nn.functional.gelu(self.conv2(x), approximate="tanh")
        mlp = self.project(nn.functional.gelu(self.expand(x.permute(0, 2, 3, 1))))
        return self.head((x + mlp.permute(0, 3, 1, 2)).flatten(1))


def _torch_step(net, x, y, dtype):
    model = _copy(net).to(dtype)
    loss = nn.functional.cross_entropy(model(x.to(dtype)).float(), y)
    loss.backward()
    return float(loss), {n: p.grad.double() for n, p in model.named_parameters()}


def _copy(net):
    import copy

    return copy.deepcopy(net)


def test_gelu_forward_and_backward_on_htp_next_to_torch(qnn_sdk):
    """Loss and every gradient within twice torch fp16's own error (relative L2) plus
    1e-3; one delegate, no op of any GELU on CPU."""
    from qnn_convbwd.toolchain import harness
    from qnn_convbwd_dev import fidelity

    torch.manual_seed(0)
    net = _Gelus()
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 4])
    joint = training.export_joint(
        training.WithLoss(_copy(net), nn.functional.cross_entropy), (x, y)
    )
    compiled = harness.lower_program(joint, "SM8650")
    # One delegate; on CPU only the permutes of the trained convolution weights into the
    # filter layout (weight_layout="hwio"), no op of a GELU's.
    assert harness.delegate_count(compiled.edge) == 1
    assert {op.rule for op in compiled.report.on_cpu} == {"weight_layout_on_cpu"}
    on_cpu = {
        str(n.target)
        for n in compiled.edge.exported_program().graph.nodes
        if n.op == "call_function"
        and "executorch_call_delegate" not in str(n.target)
        and "getitem" not in str(n.target)
        and "alloc" not in str(n.target)
    }
    assert on_cpu <= {"aten.permute_copy.out"}, on_cpu
    names = fidelity.output_names(joint)
    outputs = dict(zip(names, compiled.run([x, y])))
    loss32, grads32 = _torch_step(net, x, y, torch.float32)
    loss16, grads16 = _torch_step(net, x, y, torch.float16)
    assert abs(float(outputs["loss"]) - loss32) <= 2 * abs(loss16 - loss32) + 1e-3
    for name, reference in grads32.items():
        ours = outputs[f"net.{name}"]
        scale = reference.norm()
        error = float((ours.double() - reference).norm() / scale)
        floor = float((grads16[name] - reference).norm() / scale)
        assert error <= 2 * floor + 1e-3, f"{name}: {error:.2e} against torch fp16 {floor:.2e}"
        assert math.isfinite(error)
