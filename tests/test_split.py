"""``max_delegate_ops``: a large delegate split into pieces (``partition.split``).

The pieces must be cut where only float tensors cross (never a max pool's int
indices, never a multi-output node from its getitems), the shape-only ``full``
operands must go with their readers, and the split program must train as the
one-delegate program does.
"""

from __future__ import annotations

import types

import pytest
import torch

import qnn_convbwd
from qnn_convbwd import options, training
from qnn_convbwd.partition import split
from qnn_convbwd.toolchain import harness
from qnn_convbwd_dev import models

SOC = "SM8650"
STEPS = 5
LR = 0.1


@pytest.mark.parametrize("value", [0, -3, 2.5, "8", True])
def test_max_delegate_ops_is_validated(value):
    with pytest.raises(ValueError, match="max_delegate_ops"):
        options.Options(max_delegate_ops=value)


def _graph(spec: list[tuple[str, str, list[str], torch.dtype | None]]):
    """A tagged fx graph: (name, op, inputs, dtype) with op "placeholder" or "call";
    dtype None gives a tuple value (a multi-output node)."""
    graph = torch.fx.Graph()
    made: dict[str, torch.fx.Node] = {}
    for name, op, inputs, dtype in spec:
        if op == "placeholder":
            node = graph.placeholder(name)
        else:
            node = graph.call_function(torch.add, tuple(made[i] for i in inputs))
            node.name = name
            node.meta[split.TAG] = "qnn_0"
        value = torch.empty(2, dtype=dtype or torch.float32)
        node.meta["val"] = value if dtype is not None else (value, value)
        made[name] = node
    graph.output(made[spec[-1][0]])
    program = types.SimpleNamespace(graph_module=types.SimpleNamespace(graph=graph))
    return program, made


def _tags(made) -> dict[str, str]:
    return {name: node.meta.get(split.TAG) for name, node in made.items()}


def test_cuts_where_only_float_tensors_cross():
    # a -> b(int64) -> c -> d -> e(tuple) -> f -> g: the cut may not fall between b
    # and c (int), nor between e and f (a tuple), so with 2 ops a piece, the pieces
    # are [a], [b c], [d], [e f], [g].
    program, made = _graph(
        [
            ("x", "placeholder", [], torch.float32),
            ("a", "call", ["x"], torch.float32),
            ("b", "call", ["a"], torch.int64),
            ("c", "call", ["b"], torch.float32),
            ("d", "call", ["c"], torch.float32),
            ("e", "call", ["d"], None),
            ("f", "call", ["e"], torch.float32),
            ("g", "call", ["f"], torch.float32),
        ]
    )
    tags = {"qnn_0": "spec"}
    made_pieces = split.split(program, tags, max_ops=2)
    got = _tags(made)
    assert got["b"] == got["c"] and got["e"] == got["f"]
    assert len({got[n] for n in "abcdefg"}) == len(made_pieces) == 5
    assert max(made_pieces.values()) <= 2
    assert set(tags) == set(made_pieces) and all(v == "spec" for v in tags.values())
    # Graph order is kept: each piece is a run of consecutive nodes.
    order = [got[n] for n in "abcdefg"]
    assert order == sorted(order, key=order.index)


@pytest.mark.parametrize(
    ("b_reads", "together", "sizes"),
    [
        # b's int value, computed from a, is read by f: no cut between b and f, the
        # piece grows past the limit.
        ("a", "bcdf", [1, 1, 4]),
        # Computed from the input x alone (as a joint graph casts its labels), b goes
        # just before its reader f, and c and d can be cut: [a c], [d], [b f], [g].
        ("x", "bf", [1, 1, 2, 2]),
    ],
)
def test_a_long_int_edge(b_reads, together, sizes):
    program, made = _graph(
        [
            ("x", "placeholder", [], torch.float32),
            ("a", "call", ["x"], torch.float32),
            ("b", "call", [b_reads], torch.int64),
            ("c", "call", ["a"], torch.float32),
            ("d", "call", ["c"], torch.float32),
            ("f", "call", ["b", "d"], torch.float32),
            ("g", "call", ["f"], torch.float32),
        ]
    )
    pieces = split.split(program, {"qnn_0": "spec"}, max_ops=2)
    got = _tags(made)
    assert len({got[n] for n in together}) == 1
    assert sorted(pieces.values()) == sizes


def test_sources_and_inputs_follow_their_readers():
    # s reads no node (a full): it goes with its reader f, not with a's piece.
    # The placeholder w, read by a and f, goes to the first piece reading it.
    program, made = _graph(
        [
            ("x", "placeholder", [], torch.float32),
            ("w", "placeholder", [], torch.float32),
            ("a", "call", ["x", "w"], torch.float32),
            ("s", "call", [], torch.float32),
            ("c", "call", ["a"], torch.float32),
            ("d", "call", ["c"], torch.float32),
            ("f", "call", ["d", "s", "w"], torch.float32),
        ]
    )
    made["w"].meta[split.TAG] = "qnn_0"
    split.split(program, {"qnn_0": "spec"}, max_ops=2)
    got = _tags(made)
    assert got["s"] == got["f"] != got["a"]
    assert got["w"] == min(got["a"], got["f"])
    assert got["x"] is None


def test_small_partitions_are_left_alone():
    program, made = _graph(
        [("x", "placeholder", [], torch.float32), ("a", "call", ["x"], torch.float32)]
    )
    tags = {"qnn_0": "spec"}
    assert split.split(program, tags, max_ops=1) == {}
    assert tags == {"qnn_0": "spec"} and _tags(made)["a"] == "qnn_0"


def _lower(case, **overrides):
    with qnn_convbwd.enabled(**overrides):
        return harness.lower_program(case.joint(), SOC)


@pytest.fixture(scope="module")
def demo_whole(qnn_sdk):
    """The demo lowered as one delegate and its SGD steps beside torch's, shared by the
    split cases."""
    case = models.adapter_case("demo", trainable=True)
    whole = _lower(case)
    return case, whole, training.train_side_by_side(whole.pte, case.model, case.inputs, STEPS, LR)


@pytest.mark.htp
@pytest.mark.parametrize("max_ops", [15, 6])
def test_split_demo_trains_as_one_delegate_does(demo_whole, max_ops):
    """At 6 ops a piece, four of the nine delegates list their outputs in another
    order than QNN builds them: their QNN ops are reordered (delegate_io)."""
    case, whole, one = demo_whole
    pieces = _lower(case, max_delegate_ops=max_ops)
    assert harness.delegate_count(whole.edge) == 1
    assert harness.delegate_count(pieces.edge) >= 3
    assert pieces.report.delegated == len(pieces.report.rows) == whole.report.delegated
    assert [c.op for c in pieces.report.on_cpu] == [c.op for c in whole.report.on_cpu]
    run = training.train_side_by_side(pieces.pte, case.model, case.inputs, STEPS, LR)
    # A delegate boundary is exact for fp16 values: the same steps, to fp16 noise.
    for a, b in zip(one.steps, run.steps, strict=True):
        assert abs(a.loss - b.loss) <= 1e-3 * max(1.0, abs(a.loss)), (a, b)
    for name, (ours, theirs) in run.updates.items():
        assert ours.norm() > 0, name
        cosine = torch.nn.functional.cosine_similarity(ours.flatten(), theirs.flatten(), dim=0)
        assert cosine >= 0.98, (name, float(cosine))
    assert run.update_cosine() >= 0.99


@pytest.mark.htp
def test_split_keeps_max_pool_indices_inside_one_delegate(qnn_sdk):
    """ExecuTorch's CIFAR model (max pools with their indices on the HTP, cross-entropy):
    split into small pieces, every backward still delegated, no int64 value between
    delegates, and it trains like torch."""
    case = models.cifar_case(True)
    compiled = _lower(case, max_delegate_ops=12)
    assert harness.delegate_count(compiled.edge) >= 3
    assert compiled.report.delegated == len(compiled.report.rows)
    top = compiled.edge.exported_program().graph
    calls = [n for n in top.nodes if "executorch_call_delegate" in str(n.target)]
    for call in calls:
        for arg in call.args[1:]:
            if isinstance(arg, torch.fx.Node) and arg.op != "placeholder":
                assert arg.meta["val"].dtype.is_floating_point, (call.name, arg.name)
    run = training.train_side_by_side(compiled.pte, case.model, case.inputs, STEPS, 0.05)
    for step in run.steps:
        assert abs(step.loss - step.reference_loss) <= 3e-2 * max(1.0, abs(step.reference_loss))
    assert run.update_cosine() >= 0.98
