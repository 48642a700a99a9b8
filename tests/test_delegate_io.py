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


def _names(ops):
    """QNN's rule on plain (inputs, outputs) ops: outputs in the order ops build them."""
    return [name for _, outs in ops for name in outs if name.startswith("output_")]


def _bind(program, ops):
    return delegate_io.bind_outputs_in_order(
        program, list(ops), output_names=_names, tensor_names=lambda op: op
    )


def test_ops_are_reordered_to_build_the_outputs_in_signature_order():
    # The signature lists a then b; the ops build b first. b's op and its input's op
    # can wait: the order found builds a first and keeps every op after its inputs.
    program = _program_with_outputs(["a", "b"])
    ops = [
        (["x"], ["t"]),
        (["t"], ["output_b@0"]),
        (["x"], ["u"]),
        (["u", "t"], ["output_a@0"]),
    ]
    reordered = _bind(program, ops)
    assert _names(reordered) == ["output_a@0", "output_b@0"]
    assert sorted(reordered) == sorted(ops)
    seen = {"x"}
    for ins, outs in reordered:
        assert set(ins) <= seen, (ins, seen)
        seen |= set(outs)
    # Already in order: the same list.
    assert _bind(program, [ops[0], ops[2], ops[3], ops[1]]) == [ops[0], ops[2], ops[3], ops[1]]


def test_an_order_no_schedule_gives_still_fails():
    # a is computed from b: no order builds a first.
    program = _program_with_outputs(["a", "b"])
    ops = [(["x"], ["output_b@0"]), (["output_b@0"], ["output_a@0"])]
    with pytest.raises(delegate_io.DelegateOutputOrderError, match="signature"):
        _bind(program, ops)
