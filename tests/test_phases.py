"""stride="phases": grad_input of a strided convolution as one stride-1 TransposeConv2d
per output phase (geometry/phases.py, builders/transpose_conv_phases.py).

The quick tier checks the plan, in a float64 torch model of the QNN ops the
builder emits (StridedSlice of the HWOI filter, stride-1 TransposeConv2d with
the plan's pad_amount, zeros appended, the Reshape / Concat / Pad interleave in
NHWC, the final crop), against ``aten.convolution_backward`` over generated
configurations.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest
import torch
import torch.nn.functional as F
from programs import Config, conv_backward_of
from tiers import sweep

from qnn_convbwd.geometry import conv as geo
from qnn_convbwd.geometry import phases as phg


def phase_configs(count: int, seed: int = 0) -> list[Config]:
    """Strides 1-3 per dim with at least one > 1, kernels 1/2/3/5 (also unequal),
    padding 0 to k - 1, groups 1 / 2 / depthwise, odd and even sizes, batch 1 / 2;
    1-D as 2-D with a unit height."""
    rng = random.Random(seed)
    configs: list[Config] = []
    while len(configs) < count:
        kind = len(configs) % 3
        cin = rng.choice([2, 4, 6])
        if kind == 0:
            groups, cout = 1, rng.choice([2, 3, 4])
        elif kind == 1:
            groups, cout = 2, rng.choice([2, 4])
        else:
            groups, cout = cin, cin * rng.choice([1, 2])
        if len(configs) % 5 == 4:  # 1-D, as the plugin lowers it
            kernel = (1, rng.choice([1, 2, 3, 5]))
            stride = (1, rng.choice([2, 3]))
            size = (1, rng.randint(3, 17))
        else:
            kernel = (rng.choice([1, 2, 3, 5]), rng.choice([1, 2, 3, 5]))
            stride = (rng.choice([1, 2, 3]), rng.choice([2, 3]))
            if rng.random() < 0.5:
                stride = stride[::-1]
            size = (rng.randint(3, 17), rng.randint(3, 17))
        padding = tuple(rng.randint(0, k - 1) for k in kernel)
        config = Config(rng.choice([1, 2]), cin, cout, kernel, stride, padding, groups, size)
        if config.valid() and phg.unsupported_reason(conv_backward_of(config)) is None:
            configs.append(config)
    return configs


def model_phases(grad_output: torch.Tensor, weight: torch.Tensor, plan: phg.PhasePlan):
    """The QNN ops of the phase plan, in torch (NCHW inputs, NHWC in between)."""
    n = grad_output.shape[0]
    results = {}
    for phase in plan.phases:
        taps = tuple(slice(c, None, s) for c, s in zip(phase.offset, plan.stride))
        kernel = weight[(slice(None), slice(None), *taps)]
        assert tuple(kernel.shape[2:]) == phase.kernel
        full = F.conv_transpose2d(grad_output, kernel, groups=plan.groups)
        crop = tuple(slice(b, full.shape[2 + d] - e) for d, (b, e) in enumerate(phase.pad_amount))
        result = full[(slice(None), slice(None), *crop)]
        result = F.pad(result, [x for extra in reversed(phase.result_pad_end) for x in (0, extra)])
        assert tuple(result.shape[2:]) == plan.rows
        results[phase.offset] = result.permute(0, 2, 3, 1)  # NHWC from here
    channels = next(iter(results.values())).shape[-1]
    sizes = list(plan.rows)
    for d in reversed(range(len(sizes))):
        s = plan.stride[d]
        if s == 1:
            continue
        lead = n * math.prod(sizes[:d])
        trail = math.prod(sizes[d + 1 :]) * channels
        merged = {}
        for key in sorted({k[:d] + k[d + 1 :] for k in results}):
            parts = [results[key[:d] + (c,) + key[d:]] for c in range(plan.taps[d])]
            stacked = torch.cat([p.reshape(lead, sizes[d], 1, trail) for p in parts], dim=2)
            stacked = F.pad(stacked, [0, 0, 0, s - plan.taps[d]])
            merged[key[:d] + (0,) + key[d:]] = stacked
        sizes[d] *= s
        results = {k: v.reshape(n, *sizes, channels) for k, v in merged.items()}
    (interleaved,) = results.values()
    crop = tuple(slice(b, interleaved.shape[1 + d] - e) for d, (b, e) in enumerate(plan.crop))
    return interleaved[(slice(None), *crop, slice(None))].permute(0, 3, 1, 2)


def test_phase_plans_compute_aten_grad_input_in_float64():
    configs = phase_configs(150, seed=3)
    seen = {"depthwise": 0, "zero_phase": 0, "result_pad": 0, "one_d": 0, "odd": 0, "s3": 0}
    gen = torch.Generator().manual_seed(0)
    for config in configs:
        conv = conv_backward_of(config)
        plan = phg.plan_phases(conv)
        weight = torch.randn(conv.weight_shape, generator=gen, dtype=torch.float64)
        grad_output = torch.randn(conv.grad_output_shape, generator=gen, dtype=torch.float64)
        x = torch.zeros(conv.input_shape, dtype=torch.float64)
        (want, _, _) = torch.ops.aten.convolution_backward.default(
            grad_output, x, weight, None, list(conv.stride), list(conv.padding),
            [1, 1], False, [0, 0], conv.groups, [True, False, False],
        )  # fmt: skip
        got = model_phases(grad_output, weight, plan)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=str(config))
        # Every tap is in exactly one phase: the multiply-adds of the forward conv.
        assert sum(math.prod(p.kernel) for p in plan.phases) == math.prod(conv.kernel)
        assert all(p.kernel and min(p.kernel) >= 1 for p in plan.phases)
        seen["depthwise"] += conv.is_depthwise
        seen["zero_phase"] += any(t < s for t, s in zip(plan.taps, plan.stride))
        seen["result_pad"] += any(any(p.result_pad_end) for p in plan.phases)
        seen["one_d"] += config.size[0] == 1
        seen["odd"] += any(i % 2 for i in config.size)
        seen["s3"] += 3 in config.stride
    # The generated spread covers each case the plan treats specially.
    assert all(count >= 5 for count in seen.values()), seen


def test_every_phase_plan_uses_stride_one_and_no_output_padding():
    for config in phase_configs(40, seed=11):
        plan = phg.plan_phases(conv_backward_of(config))
        assert len(plan.phases) == math.prod(plan.taps)
        assert all(b >= 0 and e >= 0 for p in plan.phases for b, e in p.pad_amount)
        assert all(b >= 0 and e >= 0 for b, e in plan.crop)


@pytest.mark.parametrize(
    "config, reason",
    [
        (Config(1, 4, 4, (3, 3), (1, 1), (1, 1), 1, (8, 8)), "stride 1"),
        (Config(1, 4, 4, (3, 3), (2, 2), (2, 2), 1, (9, 9), dilation=(2, 2)), "dilated"),
    ],
)
def test_phases_decline_with_a_reason(config, reason):
    conv = conv_backward_of(config)
    assert reason in phg.unsupported_reason(conv)
    with pytest.raises(geo.ConvArgumentError):
        phg.plan_phases(conv)


def test_three_d_declines():
    config = Config(1, 2, 2, (3, 3, 3), (2, 2, 2), (1, 1, 1), 1, (5, 5, 5))
    assert "3-D" in phg.unsupported_reason(conv_backward_of(config))


def test_3x3_stride_2_plan():
    # 16 -> 8 (k3 s2 p1): phases c=0 (taps 0, 2) and c=1 (tap 1) per dim.
    plan = phg.plan_phases(conv_backward_of(Config(1, 8, 8, (3, 3), (2, 2), (1, 1), 1, (16, 16))))
    assert [p.offset for p in plan.phases] == list(itertools.product((0, 1), repeat=2))
    assert [p.kernel for p in plan.phases] == [(2, 2), (2, 1), (1, 2), (1, 1)]
    assert plan.rows == (9, 9) and plan.crop == ((1, 1), (1, 1))


# --- on the HTP simulator ------------------------------------------------------------------

SIMULATOR_CONFIGS = [
    Config(2, 8, 8, (3, 3), (2, 2), (1, 1), 1, (15, 16)),  # odd and even
    Config(1, 8, 8, (3, 3), (2, 2), (1, 1), 8, (10, 10)),  # depthwise, output padding 1
    Config(1, 16, 8, (1, 1), (2, 2), (0, 0), 1, (16, 16)),  # 1x1 s2: zero phases
    Config(1, 4, 8, (5, 5), (2, 2), (2, 2), 1, (13, 12)),
    Config(1, 8, 16, (3, 3), (3, 3), (1, 0), 1, (10, 14)),  # output padding > padding
    Config(1, 4, 4, (2, 5), (3, 2), (1, 4), 2, (11, 9)),  # rows past the full extent
    Config(1, 4, 6, (3,), (2,), (1,), 2, (11,)),  # 1-D (lowered as 2-D)
]


def _as_2d(config: Config) -> Config:
    """A 1-D config as the visitor sees it: a unit height (passes/conv1d.py)."""
    if len(config.stride) == 2:
        return config
    lift = dataclasses.replace
    return lift(
        config,
        kernel=(1, *config.kernel),
        stride=(1, *config.stride),
        padding=(0, *config.padding),
        size=(1, *config.size),
        dilation=(1, *config.dilation),
    )


def test_simulator_configs_cover_the_special_cases():
    plans = [phg.plan_phases(conv_backward_of(_as_2d(c))) for c in SIMULATOR_CONFIGS]
    assert any(conv_backward_of(c).is_depthwise for c in SIMULATOR_CONFIGS)
    assert any(t < s for p in plans for t, s in zip(p.taps, p.stride))
    assert any(any(ph.result_pad_end) for p in plans for ph in p.phases)
    assert any(len(c.stride) == 1 for c in SIMULATOR_CONFIGS)


@pytest.mark.parametrize("soc", sweep(["SM8850"], ["SM8450"]))  # V81; V69 with --slow
def test_phases_match_aten_on_the_simulator(qnn_sdk, soc):
    from programs import ConvBackwardBank, assert_bank_matches

    import qnn_convbwd
    from qnn_convbwd.toolchain import harness

    bank = ConvBackwardBank(SIMULATOR_CONFIGS)
    with qnn_convbwd.enabled(stride="phases"):
        compiled = harness.lower_program(bank.export(), soc)
    assert compiled.report.delegated == len(SIMULATOR_CONFIGS)
    assert harness.delegate_count(compiled.edge) == 1
    assert_bank_matches(compiled, bank)


def test_a_declined_phase_plan_is_a_fallback_in_the_report(qnn_sdk, caplog):
    """A dilated stride-2 node asked for stride="phases" is built with zero_insert: the
    report's ``fallbacks`` names it with the reason, the plain stride-2 node beside it
    has none, and both still compute aten's grad_input."""
    import logging

    from programs import ConvBackwardBank, assert_bank_matches

    import qnn_convbwd
    from qnn_convbwd.toolchain import harness

    dilated = Config(1, 4, 4, (3, 3), (2, 2), (2, 2), 1, (9, 9), dilation=(2, 2))
    plain = Config(1, 4, 4, (3, 3), (2, 2), (1, 1), 1, (9, 9))
    bank = ConvBackwardBank([dilated, plain])
    with (
        qnn_convbwd.enabled(stride="phases"),
        caplog.at_level(logging.INFO, logger="qnn_convbwd.partition.judge"),
    ):
        compiled = harness.lower_program(bank.export(), "SM8650")
    report = compiled.report
    assert report.delegated == 2, report.to_markdown()
    (row,) = [r for r in report.rows if r.dilation == [2, 2]]
    (fallback,) = report.fallbacks
    assert fallback.node == row.node and fallback.op == "convolution_backward"
    assert (fallback.asked, fallback.built) == ('stride="phases"', 'stride="zero_insert"')
    assert "dilated" in fallback.reason
    assert fallback.node in report.fallbacks_markdown()
    logged = [m for m in caplog.messages if 'falls back to stride="zero_insert"' in m]
    assert len(logged) == 1 and fallback.reason in logged[0]  # once, not per build
    assert_bank_matches(compiled, bank)

    with qnn_convbwd.enabled(stride="zero_insert"):
        asked_zero_insert = harness.lower_program(bank.export(), "SM8650")
    assert asked_zero_insert.report.fallbacks == []


def test_phase_filters_are_slices_of_the_forward_filter(qnn_sdk):
    """runtime_weight: every phase's TransposeConv2d reads a StridedSlice of the one HWOI
    Transpose of the forward Conv2d's filter; the weight is stored once."""
    from qnn_convbwd import integration
    from qnn_convbwd.builders import input_gradient_runtime_weight as rw
    from qnn_convbwd_dev import weight_bytes as wb

    config = wb.ConvConfig(32, 48, 3, stride=2, size=16)
    with integration.capture_qnn_graphs() as graphs:
        module, inputs, compiled, _ = wb.lower(config, "fwd+bwd", "SM8650", rw.NAME, 0, "phases")
    assert wb.convolutions_on_cpu(compiled) == []
    (ops,) = graphs
    producers = {t.name: op for op in ops for t in op.outputs}
    (conv,) = [op for op in ops if op.op_type == "Conv2d"]
    tconvs = [op for op in ops if op.op_type == "TransposeConv2d"]
    assert len(tconvs) == 4
    hwoi = set()
    kernels = []
    for tconv in tconvs:
        sliced = producers[tconv.inputs[1].name]
        assert sliced.op_type == "StridedSlice"
        transpose = producers[sliced.inputs[0].name]
        assert transpose.op_type == "Transpose"
        assert transpose.inputs[0].name == conv.inputs[1].name  # the forward's filter
        hwoi.add(transpose.name)
        kernels.append(tconv.inputs[1].dims[:2])
    assert len(hwoi) == 1
    assert sorted(kernels) == [(1, 1), (1, 2), (2, 1), (2, 2)]
    # Stored once: the head Concat copies and the tail the Multiply by 1.0 reads.
    head, tail = rw.stored_layout(math.prod(config.weight_shape))
    weight_parts = sorted(
        t.dims for op in ops for t in op.inputs if t.is_static and op.op_type != "Conv2d"
    )
    assert weight_parts == sorted([(1, head), (1, tail)])
    outputs = compiled.run(inputs)
    for got, want in zip(outputs, wb.reference(module, inputs), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=5e-3 * want.abs().max().item())


def test_depth_to_space_interleave_on_the_simulator(qnn_sdk, monkeypatch):
    """The measured alternative (transpose_conv_phases.INTERLEAVE): one Concat on the
    channels and DepthToSpace where every phase has taps."""
    from programs import ConvBackwardBank, assert_bank_matches

    import qnn_convbwd
    from qnn_convbwd.builders import transpose_conv_phases
    from qnn_convbwd.toolchain import harness

    monkeypatch.setattr(transpose_conv_phases, "INTERLEAVE", "depth_to_space")
    bank = ConvBackwardBank(SIMULATOR_CONFIGS[:2] + SIMULATOR_CONFIGS[3:5])
    with qnn_convbwd.enabled(stride="phases"):
        compiled = harness.lower_program(bank.export(), "SM8650")
    assert_bank_matches(compiled, bank)
