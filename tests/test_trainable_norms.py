"""Norm layers whose affine parameters train, with executorch's own visitors.

executorch's batch / layer norm visitors read their parameters' values while
building the QNN graph (``get_parameter``); a trainable parameter is a delegate
input read at run time, so ``partition/trainable.py`` keeps such a node on CPU.
The partitioner sees edge ops, named ``aten.<op>.<overload>``: the rule once
matched only ATen names, never refused, and the lowering failed in executorch's
visitor (``Expect aten_permute_copy_default_3 to be parameter, buffer, get_attr,
or lifted tensor constant``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.export.experimental import _export_forward_backward

from qnn_convbwd import api
from qnn_convbwd.partition import trainable
from qnn_convbwd_dev import fidelity, models, zoo


def _bias_only(norm: nn.Module, size: int = 8) -> models.TrainingGraph:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3),
        norm,
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )
    net.train()
    with torch.no_grad():
        net(torch.randn(4, 3, size, size))
    net.eval()
    for name, parameter in net.named_parameters():
        parameter.requires_grad_(name.endswith("bias"))
    model = zoo.Finetune(net)
    inputs = (torch.randn(1, 3, size, size), torch.randn(1, 4))
    joint = _export_forward_backward(torch.export.export(model, inputs, strict=True))
    return models.TrainingGraph("norm", model, inputs, joint)


@pytest.mark.parametrize(
    ("norm", "op"),
    [
        (nn.BatchNorm2d(8), "_native_batch_norm_legit_no_training"),
        (nn.GroupNorm(2, 8), "native_group_norm"),
    ],
)
def test_norm_reading_a_trainable_parameter_is_refused_on_the_edge_graph(norm, op):
    from executorch.exir import to_edge

    graph = _bias_only(norm)
    edge = to_edge(graph.program).exported_program()
    nodes = [n for n in edge.graph.nodes if n.op == "call_function" and op in str(n.target)]
    assert nodes, f"no {op} in the edge graph"
    for node in nodes:
        reason = trainable.refusal(node, edge)
        assert reason is not None and f"executorch's {op} visitor" in reason, reason
        assert "bias" in reason


def test_executorch_batch_norm_with_trainable_bias_stays_on_cpu_and_is_right(qnn_sdk):
    from qnn_convbwd.toolchain import harness

    graph = _bias_only(nn.BatchNorm2d(8))
    with api.enabled(batch_norm="executorch"):
        compiled = harness.lower_program(graph.program, "SM8650")
    top_level = [str(n.target) for n in compiled.edge.exported_program().graph.nodes]
    assert any("_native_batch_norm_legit_no_training" in t for t in top_level)
    outputs = zoo.joint_outputs(graph, compiled.run(list(graph.inputs)))
    report = fidelity.assess_model(graph.model, graph.inputs, graph.program, outputs)
    assert report.within, report.offending
