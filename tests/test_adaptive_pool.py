"""Adaptive average pools and their backwards as products with averaging matrices
(passes/adaptive_pool.py).

The formulation is compared with ATen's ``_adaptive_avg_pool2d`` and
``_adaptive_avg_pool2d_backward`` in float64 over generated sizes (growing, shrinking,
dividing, from and to one element, batched and not); a pool with dynamic shapes
stays, and the rule ``adaptive_pool_not_static`` keeps it on CPU naming why. On the
simulator a bank of pools and backwards runs within an fp16 bound of ATen, and a
VGG-like head (a 1x1 map pooled to 7x7) trains next to torch.
"""

from __future__ import annotations

import copy
import logging
import random

import programs
import torch
from executorch.exir import to_edge
from torch import nn

import qnn_convbwd
from qnn_convbwd import training
from qnn_convbwd.geometry import pool as pg
from qnn_convbwd.partition import judge
from qnn_convbwd.partition.target import Target
from qnn_convbwd.passes import adaptive_pool

FORWARD = "aten._adaptive_avg_pool2d.default"
BACKWARD = "aten._adaptive_avg_pool2d_backward.default"


def generated_configs(count: int, seed: int = 0) -> list[tuple[tuple[int, ...], tuple[int, int]]]:
    """(input shape, output size): both axes from 1 to 9 elements to 1 to 9, with the
    cases that matter for the formulation always among them."""
    rng = random.Random(seed)
    found = [
        ((2, 3, 1, 1), (7, 7)),  # VGG at 32 px
        ((2, 3, 6, 4), (3, 2)),  # dividing: an avg_pool
        ((2, 3, 5, 7), (1, 1)),  # global
        ((3, 5, 7), (4, 3)),  # unbatched
        ((1, 2, 4, 4), (4, 4)),  # identity: no product
    ]
    while len(found) < count:
        lead = (rng.randint(1, 3), rng.randint(1, 4))[: rng.randint(1, 2)]
        size = (rng.randint(1, 9), rng.randint(1, 9))
        found.append(((*lead, *size), (rng.randint(1, 9), rng.randint(1, 9))))
    return found


class _Pools(nn.Module):
    """Each configuration's forward and backward (the backward of the forward's input)."""

    def __init__(self, configs) -> None:
        super().__init__()
        self.configs = list(configs)

    def forward(self, *tensors):
        outputs = []
        for (_, out), x, grad in zip(self.configs, tensors[0::2], tensors[1::2]):
            outputs.append(torch.ops.aten._adaptive_avg_pool2d(x, list(out)))
            outputs.append(torch.ops.aten._adaptive_avg_pool2d_backward(grad, x))
        return tuple(outputs)

    def inputs(self, dtype=torch.float64, seed: int = 0) -> tuple[torch.Tensor, ...]:
        generator = torch.Generator().manual_seed(seed)
        found = []
        for shape, out in self.configs:
            found.append(torch.randn(shape, dtype=dtype, generator=generator))
            found.append(torch.randn((*shape[:-2], *out), dtype=dtype, generator=generator))
        return tuple(found)


def _edge(module: nn.Module, inputs: tuple, dynamic_shapes=None):
    with qnn_convbwd.enabled():
        exported = torch.export.export(module, inputs, dynamic_shapes=dynamic_shapes)
        return to_edge(exported).exported_program()


def _pool_nodes(program) -> list[torch.fx.Node]:
    return [
        n for n in program.graph.nodes if getattr(n.target, "__name__", "") in (FORWARD, BACKWARD)
    ]


def test_windows_are_atens():
    """Row i of the matrix averages exactly the inputs ATen's output i averages."""
    for in_size in range(1, 12):
        for out_size in range(1, 12):
            matrix = adaptive_pool.averaging_matrix(in_size, out_size, torch.float64)
            eye = torch.eye(in_size, dtype=torch.float64).reshape(1, in_size, in_size)
            want = torch.nn.functional.adaptive_avg_pool1d(eye, out_size)[0].T
            assert torch.allclose(matrix, want, rtol=0, atol=1e-15), (in_size, out_size)
            assert len(pg.adaptive_windows(in_size, out_size)) == out_size


def test_rewrite_matches_aten_in_float64_on_generated_configs():
    module = _Pools(generated_configs(30))
    inputs = module.inputs()
    program = _edge(module, inputs)
    assert len(_pool_nodes(program)) == 2 * len(module.configs)
    assert adaptive_pool.rewrite_adaptive_pools(program.graph_module) == 2 * len(module.configs)
    assert not _pool_nodes(program)
    calls = {n.target.__name__ for n in program.graph.nodes if n.op == "call_function"}
    assert "aten.mm.default" in calls
    for index, (got, want) in enumerate(zip(program.module()(*inputs), module(*inputs))):
        config = module.configs[index // 2]
        assert got.shape == want.shape, config
        assert torch.allclose(got, want, rtol=1e-13, atol=1e-14), config


def test_the_identity_is_no_product():
    module = _Pools([((1, 2, 4, 4), (4, 4))])
    program = _edge(module, module.inputs())
    adaptive_pool.rewrite_adaptive_pools(program.graph_module)
    calls = {n.target.__name__ for n in program.graph.nodes if n.op == "call_function"}
    assert calls == {"aten.view_copy.default"}


def test_a_pool_with_dynamic_shapes_stays_and_the_rule_names_it(caplog):
    class _Pool(nn.Module):
        def forward(self, x):
            return torch.ops.aten._adaptive_avg_pool2d(x, [3, 3])

    batch = torch.export.Dim("batch", min=2, max=8)
    program = _edge(_Pool(), (torch.randn(2, 3, 5, 5),), dynamic_shapes={"x": {0: batch}})
    assert adaptive_pool.rewrite_adaptive_pools(program.graph_module) == 0
    (node,) = _pool_nodes(program)
    context = judge.Context(Target("htp", "SM8650", 75, False, program))
    caplog.set_level(logging.INFO, logger="qnn_convbwd")
    verdict = judge.judge(node, context)
    assert verdict.rejection.rule == "adaptive_pool_not_static"
    assert "dynamic shapes" in verdict.rejection.values
    logged = [r.getMessage() for r in caplog.records]
    assert any(node.name in m and "not delegated" in m for m in logged)


def _terms(in_size: int, out_size: int, backward: bool) -> int:
    """The most inputs one output of the axis's product sums (a row of the averaging
    matrix, or a column for the backward's transposed one)."""
    nonzero = adaptive_pool.averaging_matrix(in_size, out_size, torch.float64) != 0
    return int(nonzero.sum(0 if backward else 1).max())


def _fp16_bounds(module: _Pools, inputs: tuple) -> list[torch.Tensor]:
    """Per output element: ``(terms + 4) * 2^-11`` times the same products of the
    inputs' magnitudes, ``terms`` the inputs the two axes' products sum; each input,
    matrix entry, product and partial sum is rounded to fp16 (half a unit, 2^-11)."""
    magnitudes = module(*(t.abs() for t in inputs))
    bounds = []
    for index, magnitude in enumerate(magnitudes):
        shape, out = module.configs[index // 2]
        backward = index % 2 == 1
        terms = sum(_terms(i, o, backward) for i, o in zip(shape[-2:], out))
        bounds.append((terms + 4) * 2.0**-11 * magnitude + 2.0**-24)
    return bounds


def test_bank_on_htp_matches_aten(qnn_sdk):
    """Every pool and backward delegated, within the fp16 bound of ATen's fp32."""
    from qnn_convbwd.toolchain import harness

    module = _Pools(generated_configs(12, seed=2))
    inputs = module.inputs(torch.float32)
    compiled = harness.lower_program(torch.export.export(module, inputs), "SM8650")
    graph = compiled.edge.exported_program().graph
    on_cpu = [
        str(n.target)
        for n in graph.nodes
        if n.op == "call_function" and "executorch_call_delegate" not in str(n.target)
    ]
    assert not [op for op in on_cpu if "adaptive" in op or "mm" in op]
    outputs = compiled.run(list(inputs))
    bounds = _fp16_bounds(module, tuple(t.double() for t in inputs))
    for index, (got, want, bound) in enumerate(zip(outputs, module(*inputs), bounds)):
        excess = ((got.double() - want.double()).abs() - bound).max().item()
        assert excess <= 0, f"{module.configs[index // 2]}: exceeds the fp16 bound by {excess}"


class PooledToSeven(nn.Module):
    """VGG's head at 32 px: a 1x1 map pooled to 7x7, flattened into a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.pool = nn.AdaptiveAvgPool2d((7, 7))
        self.fc = nn.Linear(8 * 49, 5)

    def forward(self, x):
        return self.fc(self.pool(torch.relu(self.conv(x))).flatten(1))


def test_the_head_trains_on_htp_next_to_torch(qnn_sdk):
    """Loss and every gradient within twice torch fp16's own error (relative L2) plus
    1e-3; no adaptive pool on CPU."""
    from qnn_convbwd.toolchain import harness
    from qnn_convbwd_dev import fidelity

    torch.manual_seed(0)
    net = PooledToSeven()
    x, y = torch.randn(4, 3, 3, 3), torch.tensor([0, 1, 2, 4])
    joint = training.export_joint(
        training.WithLoss(copy.deepcopy(net), nn.functional.cross_entropy), (x, y)
    )
    assert any("adaptive_avg_pool2d_backward" in str(n.target) for n in joint.graph.nodes)
    compiled = harness.lower_program(joint, "SM8650")
    on_cpu = [
        str(n.target)
        for n in compiled.edge.exported_program().graph.nodes
        if n.op == "call_function" and "executorch_call_delegate" not in str(n.target)
    ]
    assert not [op for op in on_cpu if "adaptive" in op or "mm" in op]
    outputs = dict(zip(fidelity.output_names(joint), compiled.run([x, y])))
    programs.assert_step_within_twice_torch_fp16(net, x, y, outputs)
