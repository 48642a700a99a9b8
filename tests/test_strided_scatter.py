"""``as_strided_scatter`` as a reshape or a pad (passes/strided_scatter.py).

The rewrite copies elements, so it is compared with ATen for equality (float64) over
generated blocks; views that are no block stay, and the rule
``strided_scatter_not_a_block`` keeps them on CPU naming why. On the simulator a
ConvNeXt-like head (a pooled 1x1 map read through a permute, whose backward holds
the scatter) trains with nothing of it on CPU.
"""

from __future__ import annotations

import copy
import logging
import math
import random

import programs
import torch
from executorch.exir import EdgeCompileConfig, to_edge
from torch import nn

import qnn_convbwd
from qnn_convbwd import training
from qnn_convbwd.geometry import strided
from qnn_convbwd.partition import judge, rewrites
from qnn_convbwd.partition.target import Target
from qnn_convbwd.passes import strided_scatter

SCATTER = "aten.as_strided_scatter.default"


def generated_blocks(count: int, seed: int = 0) -> list[tuple]:
    """(base elements, size, stride, offset) of blocks of a contiguous base, with unit
    dims of any stride mixed in, and the ``Block`` they are."""
    rng = random.Random(seed)
    found = []
    while len(found) < count:
        sizes = [rng.randint(1, 5) for _ in range(rng.randint(1, 4))]
        shape = [rng.randint(1, n) for n in sizes]
        start = [rng.randint(0, n - k) for n, k in zip(sizes, shape)]
        contiguous = [math.prod(sizes[i + 1 :]) for i in range(len(sizes))]
        size, stride = [], []
        for k, t in zip(shape, contiguous):
            if rng.random() < 0.3:  # a unit dim reads one element whatever its stride
                size.append(1)
                stride.append(rng.randint(0, 50))
            size.append(k)
            stride.append(t)
        offset = sum(s * t for s, t in zip(start, contiguous))
        found.append((math.prod(sizes), size, stride, offset))
    return found


# Views that are no block of their base, each with what the refusal names.
NOT_BLOCKS = {
    "overlapping": ((12, [3, 3], [2, 1], 0), "no block of the base read as [6, 2]"),
    "wrapping": ((12, [2, 3], [4, 1], 2), "dim 1 needs 2 + 3 > 4"),
    "broadcast": ((12, [2, 3], [0, 1], 0), "do not nest"),
    "transposed": ((12, [2, 2], [1, 2], 0), "do not nest"),
    "ragged": ((10, [3], [3], 0), "does not divide"),
}


class _Scatters(nn.Module):
    """One ``as_strided_scatter`` per view into a ``full`` base of ``value``."""

    def __init__(self, views, value: float = 0.5) -> None:
        super().__init__()
        self.views, self.value = list(views), value

    def forward(self, *sources):
        return tuple(
            torch.as_strided_scatter(torch.full([n], self.value, dtype=src.dtype), src, *view)
            for (n, *view), src in zip(self.views, sources)
        )


def _edge(module: nn.Module, inputs: tuple):
    with qnn_convbwd.enabled():
        exported = torch.export.export(module, inputs)
        config = EdgeCompileConfig(_check_ir_validity=False)  # as_strided_scatter: not core
        return to_edge(exported, compile_config=config).exported_program()


def _scatters(program) -> list[torch.fx.Node]:
    return [n for n in program.graph.nodes if getattr(n.target, "__name__", "") == SCATTER]


def test_block_of_every_generated_view_is_where_the_view_reads():
    """The ``Block`` reads the view's elements: base positions counted in ``sizes`` from
    ``start`` hold what ``as_strided`` reads, in order."""
    for n, size, stride, offset in generated_blocks(300):
        found = strided.block(n, size, stride, offset)
        base = torch.arange(n)
        read = base.as_strided(size, stride, offset).flatten()
        window = tuple(slice(s, s + k) for s, k in zip(found.start, found.shape))
        assert torch.equal(base.view(found.sizes)[window].flatten(), read), (size, stride)
        assert math.prod(found.sizes) == n


def test_rewrite_equals_aten_in_float64_on_generated_blocks():
    views = generated_blocks(40, seed=1)
    sources = tuple(torch.randn(size, dtype=torch.float64) for _, size, _, _ in views)
    module = _Scatters(views)
    program = _edge(module, sources)
    assert len(_scatters(program)) == len(views)
    assert strided_scatter.rewrite_block_scatters(program.graph_module) == len(views)
    assert not _scatters(program)
    calls = {n.target.__name__ for n in program.graph.nodes if n.op == "call_function"}
    assert "aten.constant_pad_nd.default" in calls  # partial blocks are pads of full's value
    for got, want in zip(program.module()(*sources), module(*sources)):
        assert torch.equal(got, want)


def test_a_view_covering_its_base_is_a_reshape_and_the_base_goes():
    """ConvNeXt-Tiny's case: [4, 768] written into 3072 zeros."""
    view = (3072, [4, 768], [768, 1], 0)
    src = torch.randn(4, 768, dtype=torch.float64)
    program = _edge(_Scatters([view], value=0.0), (src,))
    assert strided_scatter.rewrite_block_scatters(program.graph_module) == 1
    calls = [n.target.__name__ for n in program.graph.nodes if n.op == "call_function"]
    assert calls == ["aten.view_copy.default"]
    (got,) = program.module()(src)
    assert torch.equal(got, src.reshape(3072))


def test_views_that_are_no_block_stay_and_the_rule_names_them(caplog):
    views = [view for view, _ in NOT_BLOCKS.values()]
    sources = tuple(torch.randn(view[1]) for view in views)
    program = _edge(_Scatters(views), sources)
    assert strided_scatter.rewrite_block_scatters(program.graph_module) == 0
    found = _scatters(program)
    assert len(found) == len(views)
    context = judge.Context(Target("htp", "SM8650", 75, False, program))
    caplog.set_level(logging.INFO, logger="qnn_convbwd")
    for node, (name, (_, says)) in zip(found, NOT_BLOCKS.items()):
        assert says in rewrites.scatter_refusal(node), name
        with qnn_convbwd.enabled():
            delegated = judge.in_partitioner(node, context, lambda **_: True, lambda _: True)
        assert not delegated
        verdict = judge.judge(node, context, log=False)
        assert verdict.rejection.rule == "strided_scatter_not_a_block"
        assert says in verdict.rejection.values
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any(node.name in m and "no kernel" in m for m in warned), name


def test_a_partial_view_of_a_base_that_is_no_full_stays():
    class _IntoInput(nn.Module):
        def forward(self, base, src):
            return torch.as_strided_scatter(base, src, [2, 2], [4, 1], 1)

    program = _edge(_IntoInput(), (torch.randn(8), torch.randn(2, 2)))
    assert strided_scatter.rewrite_block_scatters(program.graph_module) == 0
    (node,) = _scatters(program)
    assert "not a full" in rewrites.scatter_refusal(node)


def test_executorchs_runtime_has_no_kernel_for_the_ops_the_rewrites_take():
    """Why what stays is warned about: executorch 1.5.1 registers no kernel for
    as_strided_scatter or the adaptive pool's backward (this fails once one does)."""
    from executorch.extension.pybindings import portable_lib

    names = portable_lib._get_operator_names()
    assert "aten::as_strided_copy.out" in names and "aten::_adaptive_avg_pool2d.out" in names
    for op in rewrites.MISSING_CPU_KERNELS:
        assert not any(name.startswith(f"aten::{op}.") for name in names), op


class PooledHead(nn.Module):
    """ConvNeXt's head at 32 px: channels-last features (a linear layer between
    permutes) pooled from a 1x1 map, a LayerNorm2d, a linear classifier. The pool's
    output is restrided by an ``as_strided``, whose backward is the scatter."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.mix = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        x = self.mix(self.conv(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        x = nn.functional.adaptive_avg_pool2d(x, 1)
        x = self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.fc(x.flatten(1))


def _joint(net: nn.Module, x: torch.Tensor, y: torch.Tensor):
    return training.export_joint(
        training.WithLoss(copy.deepcopy(net), nn.functional.cross_entropy), (x, y)
    )


def test_the_heads_joint_graph_holds_a_covering_scatter_that_decide_delegates():
    torch.manual_seed(0)
    x, y = torch.randn(4, 3, 3, 3), torch.tensor([0, 1, 2, 4])
    joint = _joint(PooledHead(), x, y)
    assert any("as_strided_scatter" in str(n.target) for n in joint.graph.nodes)
    from qnn_convbwd.toolchain import harness

    report = qnn_convbwd.decide(joint, harness.compile_specs("SM8650"))
    assert not [op for op in report.on_cpu if "strided" in op.op or "full" in op.op]


def _run(edge, x, y):
    """The edge program's graph on its parameters, buffers and (x, y)."""
    values = {**edge.state_dict, **edge.constants}
    user = iter([x, y])
    args = [
        values[spec.target] if spec.target is not None else next(user)
        for spec in edge.graph_signature.input_specs
    ]
    return edge.graph_module(*args)


def test_the_heads_joint_graph_computes_the_same_after_the_rewrite_in_float64():
    torch.manual_seed(0)
    net = PooledHead().double()
    x, y = torch.randn(4, 3, 3, 3, dtype=torch.float64), torch.tensor([0, 1, 2, 4])
    joint = _joint(net, x, y)
    with qnn_convbwd.enabled():
        program = to_edge(joint, compile_config=EdgeCompileConfig(_check_ir_validity=False))
    edge = program.exported_program()
    before = _run(edge, x, y)
    assert strided_scatter.rewrite_block_scatters(edge.graph_module) == 1
    after = _run(edge, x, y)
    assert len(before) == len(after)
    for got, want in zip(after, before):
        assert torch.equal(got, want)


def test_the_head_trains_on_htp_next_to_torch(qnn_sdk):
    """The joint graph holds a covering scatter; lowered, loss and every gradient within
    twice torch fp16's own error (relative L2) plus 1e-3; no scatter, no full and no
    view of the head on CPU."""
    from qnn_convbwd.toolchain import harness
    from qnn_convbwd_dev import fidelity

    torch.manual_seed(0)
    net = PooledHead()
    x, y = torch.randn(4, 3, 3, 3), torch.tensor([0, 1, 2, 4])
    joint = _joint(net, x, y)
    assert any("as_strided_scatter" in str(n.target) for n in joint.graph.nodes)
    compiled = harness.lower_program(joint, "SM8650")
    on_cpu = [
        str(n.target)
        for n in compiled.edge.exported_program().graph.nodes
        if n.op == "call_function" and "executorch_call_delegate" not in str(n.target)
    ]
    assert not [op for op in on_cpu if "strided" in op or "full" in op or "pad" in op]
    outputs = dict(zip(fidelity.output_names(joint), compiled.run([x, y])))
    programs.assert_step_within_twice_torch_fp16(net, x, y, outputs)
