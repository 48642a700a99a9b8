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
