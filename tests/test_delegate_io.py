"""The check that QNN binds a delegate's outputs in the order of its signature."""

from __future__ import annotations

import operator

import pytest
import torch

from qnn_convbwd import delegate_io


def _program_with_outputs(names: list[str]):
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    nodes = [graph.call_function(operator.neg, (x,), name=name) for name in names]
    graph.output(nodes)

    class Program:
        graph_module = torch.fx.GraphModule(torch.nn.Module(), graph)

    return Program()


def test_output_order_mismatch_fails_loudly():
    program = _program_with_outputs(["a", "b"])
    delegate_io.check_output_order(program, ["output_a@0", "output_b@0"])
    with pytest.raises(delegate_io.DelegateOutputOrderError, match="signature"):
        delegate_io.check_output_order(program, ["output_b@0", "output_a@0"])
