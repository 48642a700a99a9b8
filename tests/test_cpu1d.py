"""1-D convolution_backward nodes that stay on CPU run there.

executorch's CPU kernel computes 2-D, non-transposed convolution_backward only.
The transform pass lifts a 1-D node that stays on CPU to 2-D through views of
its own operands (``passes/conv1d.py``). Each test shows the node in the
top-level graph, 2-D, in no delegate, and the program computing torch
autograd's numbers; the report keeps the original node's verdict.

On V68 (SM8350) the stacks are linear with a dot-product loss: there the HTP
compiler fails on the mse loss's ``sub`` and on relu's backward ``where`` of
these graphs (QAIRT 2.51 simulator: "could not create op q::flat_from_vtcm" /
"q::Select.exe"), with or without any convolution_backward on HTP.
"""

from __future__ import annotations

import logging

import cases
import pytest
import torch
from test_gates import CPU_CANNOT_RUN, NOT_DELEGATED, lowered_graphs

from qnn_convbwd_dev import models

V68 = "SM8350"
CONV_BWD_OP = "aten.convolution_backward.default"
SKIPPED = "kept on CPU by executorch's skip options"
VIEWS = ("view", "view_copy")


def top_level(edge) -> list[torch.fx.Node]:
    return cases.conv_backward_nodes(edge.exported_program().graph)


def delegated_nodes(edge) -> list[torch.fx.Node]:
    return [n for g in lowered_graphs(edge) for n in cases.conv_backward_nodes(g)]


def assert_2d(node: torch.fx.Node) -> None:
    """What executorch's CPU kernel runs: 4-D operands, two entries per spatial argument."""
    grad_output, inp, weight = node.args[:3]
    assert [t.meta["val"].dim() for t in (grad_output, inp, weight)] == [4, 4, 4], node
    assert all(len(node.args[i]) == 2 for i in (4, 5, 6)), node.args  # stride, padding, dilation
    assert not node.args[7], "transposed"


def weight_source(node: torch.fx.Node) -> torch.fx.Node:
    """The node the CPU node's weight is a view of (through executorch's memory.view)."""
    weight = node.args[2]
    while weight.op == "call_function" and any(v in str(weight.target) for v in VIEWS):
        weight = weight.args[0]
    return weight


def assert_matches_autograd(compiled, graph: models.TrainingGraph) -> float:
    reference = graph.reference()
    outputs = compiled.run(graph.inputs)[: len(reference)]
    worst = 0.0
    for got, want in zip(outputs, reference, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=5e-3 * want.abs().max().item() + 1e-6)
        worst = max(worst, (got - want).abs().max().item())
    return worst


@pytest.mark.htp
@pytest.mark.parametrize("trainable", [False, True], ids=["frozen", "trainable"])
def test_v68_runs_every_1d_node_on_cpu_as_2d(qnn_sdk, trainable, caplog):
    from qnn_convbwd.toolchain import harness

    graph = models.audio1d_graph(trainable_backbone=trainable, relu=False, loss="dot")
    caplog.set_level(logging.INFO, logger="qnn_convbwd")
    compiled = harness.lower_program(graph.program, V68)

    rows = compiled.report.rows
    assert len(rows) == 3
    for row in rows:  # the original node's verdict, 1-D geometry and all
        assert not row.delegated and "arch=V68" in row.reason, row
        assert row.cpu_refusal is None and len(row.stride) == 1
    lines = [r for r in caplog.records if NOT_DELEGATED.match(r.getMessage())]
    assert [r.convbwd_rule for r in lines] == ["htp_arch_supported"] * 3
    assert not [r for r in caplog.records if CPU_CANNOT_RUN.match(r.getMessage())]

    nodes = top_level(compiled.edge)
    assert len(nodes) == 3 and not delegated_nodes(compiled.edge)
    program = compiled.edge.exported_program()
    parameters = program.graph_signature.inputs_to_parameters
    for node in nodes:
        assert_2d(node)
        # The weight is a view of the model's own 1-D parameter: no 4-D copy.
        source = weight_source(node)
        assert source.op == "placeholder" and source.name in parameters, source
    # Stored once: every weight's bytes appear once in the program.
    for name, param in graph.model.named_parameters():
        assert compiled.pte.count(param.detach().numpy().tobytes()) == 1, name
    assert_matches_autograd(compiled, graph)


@pytest.mark.htp
@pytest.mark.parametrize("skip", ["op", "id"])
def test_skip_options_keep_1d_nodes_on_cpu(qnn_sdk, skip, caplog):
    """On V69+ (SM8650) the skipped 1-D nodes stay on CPU, lifted to 2-D; with
    skip_node_id_set the named node is the one kept there, though the split of
    another node renumbers the nodes after the transform pass."""
    from executorch.exir import to_edge

    from qnn_convbwd.toolchain import harness

    graph = models.audio1d_graph(trainable_backbone=True)
    # skip_node_id_set names nodes as executorch's to_edge does: the strided conv's.
    (strided,) = [
        n.name
        for n in cases.conv_backward_nodes(to_edge(graph.program).exported_program().graph)
        if list(n.args[4]) == [2]
    ]
    options = (
        {"skip_node_op_set": {CONV_BWD_OP}} if skip == "op" else {"skip_node_id_set": {strided}}
    )
    caplog.set_level(logging.INFO, logger="qnn_convbwd")
    compiled = harness.lower_program(graph.program, "SM8650", **options)

    rows = {r.node: r for r in compiled.report.rows}
    kept = set(rows) if skip == "op" else {"convolution_backward_1"}
    assert rows["convolution_backward_1"].stride == [2]
    for name, row in rows.items():
        if name in kept:
            assert not row.delegated and row.reason == SKIPPED, row
        else:
            assert row.delegated, row
    # No rule rejects them: the one line for each is the skip options' (partition.judge).
    lines = [r for r in caplog.records if NOT_DELEGATED.match(r.getMessage())]
    assert lines and {r.convbwd_rule for r in lines} == {"skip_options"}, lines

    nodes = top_level(compiled.edge)
    assert len(nodes) == len(kept)
    for node in nodes:
        assert_2d(node)
    if skip == "id":
        assert list(nodes[0].args[4]) == [1, 2], "another node than the strided one on CPU"
        assert delegated_nodes(compiled.edge)
    else:
        assert not delegated_nodes(compiled.edge)
    assert_matches_autograd(compiled, graph)
