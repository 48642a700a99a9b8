"""The whole convolution backward on HTP: grad_weight, grad_bias, dilation.

Tolerances. Every output is a sum of products, so rounding the operands to fp16
bounds its error element-wise by ~3u times the same sum over absolute values
(``programs.fp16_error_bounds``), u = 2^-11; tests allow 4u. For whole
training graphs that bound does not apply: relu masks and cancellations make the
gradients sensitive to the forward's rounding. There the tolerance is measured,
not assumed: the simulator's error may be at most twice (plus a small floor) the
error torch itself makes in fp32 when the inputs and weights are merely rounded
to fp16.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from programs import Config, ConvBackwardBank, assert_bank_matches
from tiers import ANOTHER_ARCH, sweep

from qnn_convbwd_dev import models

BOUND_FACTOR = 4.0

MASKS = [(True, True, True), (False, True, True), (False, True, False), (False, False, True)]

CONFIGS = [
    Config(2, 8, 16, (3, 3), (2, 2), (1, 1), 1, (15, 15), mask=MASKS[0]),
    Config(1, 8, 8, (3, 3), (1, 1), (1, 1), 8, (12, 11), mask=MASKS[0]),  # depthwise
    Config(2, 8, 16, (3, 3), (1, 1), (2, 2), 2, (13, 12), dilation=(2, 2), mask=MASKS[0]),
    Config(1, 16, 8, (1, 1), (2, 2), (0, 0), 1, (9, 10), mask=MASKS[1]),
    Config(1, 8, 8, (5, 3), (3, 2), (2, 1), 1, (16, 13), mask=MASKS[1]),
    Config(2, 4, 8, (3, 3), (1, 1), (3, 3), 4, (10, 10), dilation=(3, 3), mask=MASKS[2]),
    Config(1, 8, 8, (3, 1), (1, 1), (1, 0), 1, (9, 9), mask=MASKS[3]),
    Config(1, 8, 16, (3, 3), (2, 2), (2, 2), 1, (14, 14), dilation=(2, 1), mask=MASKS[0]),
]


# Pointwise convolutions (one-tap kernel, no padding, one group): grad_weight is one
# MatMul over M = N * prod(out) rows (builders/weight_gradient.py). M below: 35, 60,
# 64, 45, 99, 60, 24, 60, 50 (most not multiples of 32); batch 1 to 3; C_in or C_out 1.
POINTWISE = [
    Config(1, 16, 8, (1, 1), (1, 1), (0, 0), 1, (7, 5), mask=MASKS[2]),
    Config(2, 3, 24, (1, 1), (1, 1), (0, 0), 1, (6, 5), mask=MASKS[0]),
    Config(1, 32, 64, (1, 1), (1, 1), (0, 0), 1, (8, 8), mask=MASKS[1]),
    Config(3, 8, 1, (1, 1), (1, 1), (0, 0), 1, (5, 3), mask=MASKS[2]),
    Config(1, 1, 8, (1, 1), (1, 1), (0, 0), 1, (9, 11), mask=MASKS[0]),
    # Strided: the input is sampled by a StridedSlice first (odd and even sizes).
    Config(2, 8, 16, (1, 1), (2, 2), (0, 0), 1, (9, 10), mask=MASKS[1]),
    Config(1, 8, 12, (1, 1), (1, 3), (0, 0), 1, (4, 16), dilation=(2, 2), mask=MASKS[2]),
    # 3-D: NDHWC flattened the same way.
    Config(2, 4, 6, (1, 1, 1), (1, 1, 1), (0, 0, 0), 1, (3, 2, 5), mask=MASKS[1]),
    Config(2, 4, 6, (1, 1, 1), (2, 1, 2), (0, 0, 0), 1, (9, 5, 9), mask=MASKS[0]),
]
# Kernels of one tap that are not pointwise, and one that is not one tap: still a Conv.
NOT_POINTWISE = [
    Config(1, 8, 8, (1, 1), (1, 1), (1, 1), 1, (6, 6), mask=MASKS[2]),  # padded
    Config(2, 8, 8, (1, 1), (1, 1), (0, 0), 2, (6, 7), mask=MASKS[2]),  # grouped
    Config(1, 8, 8, (3, 3), (1, 1), (1, 1), 1, (6, 6), mask=MASKS[2]),
]


def _check(compiled, bank: ConvBackwardBank) -> float:
    return assert_bank_matches(compiled, bank, BOUND_FACTOR)


@pytest.mark.parametrize("soc", sweep(["SM8850"], ["SM8550"]))  # V81; V73 with --slow
def test_weight_bias_and_dilated_gradients_match_aten(qnn_sdk, soc):
    from qnn_convbwd.toolchain import harness

    bank = ConvBackwardBank(CONFIGS)
    compiled = harness.lower_program(bank.export(), soc)
    assert compiled.report.delegated == len(CONFIGS)
    assert harness.delegate_count(compiled.edge) == 1
    _check(compiled, bank)


@pytest.mark.parametrize("soc", sweep(["SM8650"], ["SM8550", "SM8850"]))
def test_pointwise_weight_gradients_match_aten(qnn_sdk, soc):
    from qnn_convbwd import integration
    from qnn_convbwd.toolchain import harness

    bank = ConvBackwardBank(POINTWISE)
    with integration.capture_qnn_graphs() as graphs:
        compiled = harness.lower_program(bank.export(), soc)
    assert compiled.report.delegated == len(POINTWISE)
    types = [op.op_type for graph in graphs for op in graph]
    assert types.count("MatMul") == sum(c.mask[1] for c in POINTWISE)
    assert "Conv2d" not in types and "Conv3d" not in types, sorted(set(types))
    _check(compiled, bank)


def test_only_pointwise_weight_gradients_are_a_matmul(qnn_sdk):
    """grad_weight of a pointwise convolution is a MatMul of the input and grad_output,
    each ``[M, C]``; a padded or grouped one-tap kernel, and a 3x3 one, stay a Conv2d
    whose filter is grad_output (a run-time tensor)."""
    from qnn_convbwd import integration
    from qnn_convbwd.toolchain import harness

    configs = [POINTWISE[0], POINTWISE[5], *NOT_POINTWISE]
    bank = ConvBackwardBank(configs)
    with integration.capture_qnn_graphs() as graphs:
        compiled = harness.lower_program(bank.export(), "SM8650")
    assert compiled.report.delegated == len(configs)
    ops = [op for graph in graphs for op in graph]
    matmuls = sorted(
        (op.inputs[0].dims, op.inputs[1].dims, op.outputs[0].dims)
        for op in ops
        if op.op_type == "MatMul"
    )
    # The bank's weights are frozen: grad_weight leaves as OIHW, so the product is
    # [C_out, C_in] (grad_output first, transposed).
    expected = []
    for c in configs[:2]:
        rows = c.batch * math.prod(c.output_size)
        expected.append(((rows, c.cout), (rows, c.cin), (c.cout, c.cin)))
    assert matmuls == sorted(expected)
    assert all(not t.is_static for op in ops if op.op_type == "MatMul" for t in op.inputs)
    convs = [op for op in ops if op.op_type == "Conv2d"]
    assert len(convs) == len(NOT_POINTWISE)
    assert all(not op.inputs[1].is_static for op in convs)
    _check(compiled, bank)


def test_split_keeps_each_gradient_in_its_own_node(qnn_sdk):
    """A node asking for grad_input and grad_weight is split before partitioning;
    each half is delegated and the outputs reach the right buffers."""
    from qnn_convbwd.toolchain import harness

    bank = ConvBackwardBank([CONFIGS[0]])
    compiled = harness.lower_program(bank.export(), "SM8650")  # through qnn_convbwd.lower
    assert [r.delegated for r in compiled.report.rows] == [True]
    _check(compiled, bank)


def _rounded_reference_error(graph: models.TrainingGraph) -> list[float]:
    """Max error torch makes in fp32 when inputs and weights are rounded to fp16."""
    model = copy.deepcopy(graph.model)
    model.load_state_dict({k: v.half().float() for k, v in graph.model.state_dict().items()})
    inputs = tuple(t.half().float() for t in graph.inputs)
    rounded = models.autograd_reference(model, inputs, graph.program)
    return [(a - b).abs().max().item() for a, b in zip(rounded, graph.reference(), strict=True)]


# Each backbone on one SoC, each SoC once; the other two pairs with --slow.
@pytest.mark.parametrize(
    ("backbone", "soc"),
    [
        ("resnet", "SM8550"),
        ("mobilenet", "SM8850"),
        pytest.param("resnet", "SM8850", marks=pytest.mark.slow(reason=ANOTHER_ARCH)),
        pytest.param("mobilenet", "SM8550", marks=pytest.mark.slow(reason=ANOTHER_ARCH)),
    ],
)
def test_fully_trainable_network_runs_every_backward_on_htp(qnn_sdk, backbone, soc):
    from qnn_convbwd.toolchain import harness

    graph = models.training_graph(backbone, size=15, trainable_backbone=True)
    compiled = harness.lower_program(graph.program, soc)
    assert compiled.report.rows and all(r.delegated for r in compiled.report.rows)
    assert any(r.output_mask == [True, True, True] for r in compiled.report.rows)
    assert harness.delegate_count(compiled.edge) == 1
    reference = graph.reference()
    sensitivity = _rounded_reference_error(graph)
    outputs = compiled.run(graph.inputs)[: len(reference)]
    for got, expected, noise in zip(outputs, reference, sensitivity, strict=True):
        tol = 2 * noise + 1e-3 * expected.abs().max().item()
        assert (got - expected).abs().max().item() <= tol


@pytest.mark.parametrize("trainable", [False, True], ids=["frozen", "trainable"])
def test_conv1d_backward_lowers_through_the_2d_path(qnn_sdk, trainable):
    from qnn_convbwd.toolchain import harness

    graph = models.audio1d_graph(trainable_backbone=trainable)
    compiled = harness.lower_program(graph.program, "SM8650")
    assert compiled.report.rows and all(r.delegated for r in compiled.report.rows)
    expected = graph.reference()
    for got, want in zip(compiled.run(graph.inputs)[: len(expected)], expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=5e-3 * want.abs().max().item() + 1e-6)
