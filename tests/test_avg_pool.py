"""aten.avg_pool2d_backward: on the HTP, and right where it stays on CPU.

The formulation (a reciprocal-divisor multiply, then every window offset placed by
``pool_placement``) is checked in numpy against torch over generated configurations
(no SDK); the simulator runs a bank of configurations in one program, one of which
the rules keep on CPU. Tolerance: ``qnn_convbwd_dev.avg_pool_bank``'s docstring.
"""

from __future__ import annotations

import collections
import logging
import random

import numpy as np
import pytest
import torch
from executorch.exir import to_edge
from torch import nn

import qnn_convbwd
from qnn_convbwd import integration, nodes
from qnn_convbwd.builders import op_avg_pool_backward as apb
from qnn_convbwd.geometry import pool as pg
from qnn_convbwd.partition import avg_pool, judge
from qnn_convbwd.partition.target import Target
from qnn_convbwd_dev.avg_pool_bank import CONFIGS, AvgPoolBank, pool_args

BACKWARD = "avg_pool2d_backward"


def generated_configs(count: int, seed: int = 0) -> list[tuple]:
    rng = random.Random(seed)
    configs = []
    while len(configs) < count:
        kernel = (rng.randint(1, 4), rng.randint(1, 4))
        stride = (rng.randint(1, 4), rng.randint(1, 4))
        padding = tuple(rng.randint(0, k // 2) for k in kernel)
        size = (rng.randint(3, 11), rng.randint(3, 11))
        divisor = rng.choice([None, None, None, rng.randint(1, 7)])
        config = (kernel, stride, padding, rng.random() < 0.4, rng.random() < 0.5, divisor, size)
        try:
            torch.ops.aten.avg_pool2d(torch.zeros(1, 1, *size), *pool_args(config))
        except RuntimeError:
            continue  # torch rejects it (output too small)
        configs.append(config)
    return configs


def _program(configs, dtype=torch.float32):
    """The edge program of ``AvgPoolBank(configs)``: one backward node per config."""
    bank = AvgPoolBank(configs)
    inputs = tuple(t.to(dtype) for t in bank.inputs())
    with qnn_convbwd.enabled():
        return to_edge(torch.export.export(bank, inputs)).exported_program()


def _nodes(program) -> list[torch.fx.Node]:
    return [n for n in program.graph.nodes if nodes.is_avg_pool_backward(n)]


def _formulation_numpy(pool: pg.AvgPoolBackward, grad: np.ndarray) -> np.ndarray:
    """The visitor's ops in numpy (NCHW, float64): scale, place every offset, crop."""
    scaled = grad * apb.reciprocal_table(pool)[..., 0][:, None].astype(np.float64)
    canvas = np.zeros((*grad.shape[:2], *pool.canvas()))
    for offset in pool.offsets():
        rows = slice(offset[0], offset[0] + pool.stride[0] * pool.out_sizes[0], pool.stride[0])
        cols = slice(offset[1], offset[1] + pool.stride[1] * pool.out_sizes[1], pool.stride[1])
        canvas[:, :, rows, cols] += scaled
    (p0, p1), (i0, i1) = pool.padding, pool.in_sizes
    return canvas[:, :, p0 : p0 + i0, p1 : p1 + i1]


@pytest.mark.parametrize("seed", [0])
def test_formulation_matches_aten_on_generated_configs(seed):
    """Divisors (count_include_pad, ceil_mode, divisor_override) and placement against
    torch's own backward in float64, over ``CONFIGS`` and 24 generated configurations:
    equal but for the fp32 reciprocals of the divisors (a relative 2^-24 per term); a
    gradient in the wrong place or divided by the wrong count is off by far more."""
    configs = [*CONFIGS.values(), *generated_configs(24, seed)]
    found = _nodes(_program(configs))
    assert len(found) == len(configs)
    for config, node in zip(configs, found):
        with qnn_convbwd.enabled():
            pool = pg.parse_avg(node)
        assert (pool.kernel, pool.stride, pool.padding) == config[:3]
        assert (pool.ceil_mode, pool.count_include_pad, pool.divisor_override) == config[3:6]
        x, g = AvgPoolBank([config]).inputs(seed)
        want = torch.ops.aten.avg_pool2d_backward(g.double(), x.double(), *pool_args(config))
        got = _formulation_numpy(pool, g.double().numpy())
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-6, atol=1e-7, err_msg=str(config))


def test_a_uniform_divisor_is_one_number():
    program = _program([CONFIGS["k2s2_densenet"], CONFIGS["k3s1p1_exclude_pad"]])
    with qnn_convbwd.enabled():
        densenet, edges = (pg.parse_avg(node) for node in _nodes(program))
    assert apb.reciprocal_table(densenet).shape == (1, 1, 1, 1)
    assert apb.reciprocal_table(densenet).item() == 0.25
    table = apb.reciprocal_table(edges)[0, :, :, 0]
    assert table.shape == (7, 7)
    assert table[0, 0] == np.float32(1 / 4) and table[0, 3] == np.float32(1 / 6)
    assert table[3, 3] == np.float32(1 / 9)


def test_arguments_that_are_not_a_pool_are_a_parse_rejection():
    with qnn_convbwd.enabled():
        program = _program([CONFIGS["k2s2_densenet"]])
        (node,) = _nodes(program)
        node.args[0].meta["val"] = torch.empty(2, 3, 3, 3)  # not the pooled size of 8x8
        target = Target("htp", "SM8650", 75, False, program)
        decision = avg_pool.decide(node, target, log=False)
    assert decision.rejection.rule == "parse"
    assert "not torch's pooled size" in decision.rejection.values


class _Transition(nn.Module):
    """DenseNet's transition (batch norm, ReLU, 1x1 convolution, 2x2 average pool) and a
    head, trained in train()."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(4)
        self.conv = nn.Conv2d(4, 4, 1, bias=False)
        self.pool = nn.AvgPool2d(2, 2)
        self.head = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        x = self.pool(self.conv(torch.relu(self.norm(x))))
        return self.head(x.flatten(1))


@pytest.mark.slow(reason="a joint training graph lowered and stepped; the bank covers the op")
def test_densenets_transition_trains_on_htp_next_to_torch(qnn_sdk):
    """In train() (batch statistics), cross-entropy: no pool backward left on CPU, and
    the loss and every gradient within twice torch fp16's own error plus 1e-3."""
    import copy

    from qnn_convbwd import training
    from qnn_convbwd.toolchain import harness
    from qnn_convbwd_dev import fidelity

    torch.manual_seed(0)
    net = _Transition().train()
    x, y = torch.randn(4, 4, 8, 8), torch.tensor([0, 2, 1, 1])
    module = training.WithLoss(copy.deepcopy(net), nn.functional.cross_entropy)
    joint = training.export_joint(module, (x, y))
    assert any(
        nodes.is_call(n, torch.ops.aten.avg_pool2d_backward.default) for n in joint.graph.nodes
    )
    compiled = harness.lower_program(joint, "SM8650")
    assert _left_on_cpu(compiled.edge) == 0
    outputs = dict(zip(fidelity.output_names(joint), compiled.run([x, y])))
    reference = {}
    for dtype in (torch.float32, torch.float16):
        model = copy.deepcopy(net).to(dtype)
        loss = nn.functional.cross_entropy(model(x.to(dtype)).float(), y)
        loss.backward()
        grads = {n: p.grad.double() for n, p in model.named_parameters()}
        reference[dtype] = float(loss), grads
    (loss32, grads32), (loss16, grads16) = reference[torch.float32], reference[torch.float16]
    assert abs(float(outputs["loss"]) - loss32) <= 2 * abs(loss16 - loss32) + 1e-3
    for name, want in grads32.items():
        error = float((outputs[f"net.{name}"].double() - want).norm() / want.norm())
        floor = float((grads16[name] - want).norm() / want.norm())
        assert error <= 2 * floor + 1e-3, f"{name}: {error:.2e} against torch fp16 {floor:.2e}"


def _left_on_cpu(edge) -> int:
    graph = edge.exported_program().graph
    return sum(BACKWARD in str(n.target) for n in graph.nodes if n.op == "call_function")


def test_bank_on_htp_matches_aten(qnn_sdk):
    """Every configuration of ``CONFIGS`` delegated, and within the fp16 bound."""
    from qnn_convbwd.toolchain import harness

    bank = AvgPoolBank(CONFIGS.values())
    inputs = bank.inputs()
    with integration.capture_qnn_graphs() as graphs:
        compiled = harness.lower_program(torch.export.export(bank, inputs), "SM8650")
    assert _left_on_cpu(compiled.edge) == 0
    ops = collections.Counter(
        op.op_type for graph in graphs for op in graph if op.name.startswith(f"aten_{BACKWARD}")
    )
    assert ops["ElementWiseMultiply"] == len(CONFIGS)  # no configuration divides by 1
    assert ops["Concat"] > 0  # strided ones interleave their phases
    expected = bank(*inputs)
    outputs = compiled.run(list(inputs))
    for name, got, want, bound in zip(CONFIGS, outputs, expected, bank.bounds(inputs)):
        excess = ((got - want).abs() - bound).max().item()
        assert excess <= 0, f"{name}: error exceeds the fp16 bound by {excess}"


def test_executorchs_runtime_has_no_kernel_for_it():
    """Why a node kept on CPU is warned about: executorch 1.5.1 registers no
    avg_pool2d_backward kernel (this fails once a release adds one)."""
    from executorch.extension.pybindings import portable_lib

    names = portable_lib._get_operator_names()
    assert "aten::avg_pool2d.out" in names
    assert not any(name.startswith("aten::avg_pool2d_backward") for name in names)


def test_a_node_kept_on_cpu_is_warned_about(caplog):
    """On V68 the rules keep it on CPU, where the program cannot load: one warning."""
    program = _program([CONFIGS["k2s2_densenet"]])
    (node,) = _nodes(program)
    context = judge.Context(Target("htp", "SM8350", 68, False, program))
    caplog.set_level(logging.INFO, logger="qnn_convbwd")
    with qnn_convbwd.enabled():
        delegated = judge.in_partitioner(node, context, lambda **_: True, lambda other: True)
    assert not delegated
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and node.name in warnings[0].getMessage()
    assert "no kernel" in warnings[0].getMessage()
