"""The HTP's padding defect: a convolution whose padding reaches its filter's extent.

``geometry.conv.padding_reaches_filter``: garbage on the HTP (QAIRT 2.51). The
plugin's grad_weight convolution computes only the kernel taps that read data
(the others are zeros), and a forward convolution of that kind stays on CPU.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import qnn_convbwd
from qnn_convbwd.geometry import conv as geo
from qnn_convbwd_dev import fidelity, models


def _backward(i: int, k: int, p: int, s: int, d: int, groups: int = 1, channels: int = 2):
    o = (i + 2 * p - d * (k - 1) - 1) // s + 1
    return geo.ConvBackward(
        grad_output_shape=(1, channels, o, o),
        input_shape=(1, channels, i, i),
        weight_shape=(channels, channels // groups, k, k),
        stride=(s, s),
        padding=(p, p),
        dilation=(d, d),
        transposed=False,
        output_padding_arg=(0, 0),
        groups=groups,
        output_mask=(False, True, False),
        dtype=torch.float32,
    )


def _emulate(plan: geo.WeightGradPlan, conv: geo.ConvBackward, x, g) -> torch.Tensor:
    """The plan's ops in torch (dense convolutions): the batch/channel-swapped input
    convolved with grad_output as the filter, cropped to the computed taps, the zero
    taps padded back."""
    image = x.transpose(0, 1)  # [C_in, N, *spatial]
    filt = g.transpose(0, 1)  # [C_out, N, *out]
    (top, bottom), (left, right) = plan.pad_amount
    image = nn.functional.pad(image, (left, right, top, bottom))
    full = nn.functional.conv2d(image, filt, stride=plan.stride, dilation=plan.dilation)
    computed = full[:, :, : plan.taps[0], : plan.taps[1]]
    (a0, a1), (b0, b1) = plan.zero_taps
    return nn.functional.pad(computed, (b0, b1, a0, a1)).transpose(0, 1)


GEOMETRIES = [
    (i, k, p, s, d)
    for i, k, s, d in itertools.product((1, 2, 3, 4), (1, 2, 3, 5, 7), (1, 2), (1, 2))
    for p in range(k)
    if i + 2 * p - d * (k - 1) - 1 >= 0
]


def test_the_weight_gradient_plan_never_asks_for_the_defect_and_matches_torch():
    reached = 0
    for i, k, p, s, d in GEOMETRIES:
        conv = _backward(i, k, p, s, d)
        plan = geo.plan_weight_gradient(conv)
        extents = [(o - 1) * s + 1 for o in conv.grad_output_shape[2:]]
        assert not geo.padding_reaches_filter(plan.pad_amount, extents), (i, k, p, s, d, plan)
        reached += plan.taps != conv.kernel
        torch.manual_seed(0)
        x = torch.randn(conv.input_shape)
        g = torch.randn(conv.grad_output_shape)
        w = torch.randn(conv.weight_shape)
        expected = torch.ops.aten.convolution_backward(
            g, x, w, None, [s, s], [p, p], [d, d], False, [0, 0], 1, [False, True, False]
        )[1]
        got = _emulate(plan, conv, x, g)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=str((i, k, p, s, d)))
    assert reached >= 10  # the sweep holds geometries with taps reading only padding


def test_padding_reaches_filter_is_the_measured_condition():
    assert geo.padding_reaches_filter([(2, 2)], [2])  # 2x2 filter, padding 2: garbage
    assert geo.padding_reaches_filter([(3, 0)], [3])
    assert not geo.padding_reaches_filter([(1, 1)], [2])  # right
    assert not geo.padding_reaches_filter([(2, 2)], [1])  # a 1-tap filter: right


# --- on the HTP -----------------------------------------------------------------------


class _AdapterThenConv(nn.Module):
    """A trained 1x1 adapter (so the convolution has grad_input and grad_weight)."""

    def __init__(self, channels: int, k: int, p: int, groups: int) -> None:
        super().__init__()
        self.adapter = nn.Conv2d(channels, channels, 1)
        self.conv = nn.Conv2d(channels, channels, k, padding=p, groups=groups, bias=False)

    def forward(self, x, target):
        return nn.functional.mse_loss(self.conv(self.adapter(x)), target)


@pytest.mark.htp
@pytest.mark.parametrize(
    "channels, k, p, groups, size",
    [(144, 5, 2, 144, 2), (16, 5, 2, 1, 2), (16, 7, 3, 16, 3)],
    ids=["depthwise-5x5-at-2x2", "dense-5x5-at-2x2", "depthwise-7x7-at-3x3"],
)
def test_grad_weight_where_taps_read_only_padding_matches_torch(
    qnn_sdk, channels, k, p, groups, size
):
    """MobileNetV3-Small's 5x5 depthwise convolutions at 2x2 (32 px input): their
    grad_weight was all zeros or up to 7e5 before, and the full step segfaulted."""
    from torch.export.experimental import _export_forward_backward

    from qnn_convbwd.toolchain import harness

    torch.manual_seed(0)
    model = _AdapterThenConv(channels, k, p, groups).eval()
    x = torch.randn(1, channels, size, size)
    with torch.no_grad():
        target = torch.randn_like(model.conv(model.adapter(x)))
    program = _export_forward_backward(torch.export.export(model, (x, target), strict=True))
    with qnn_convbwd.enabled():
        compiled = harness.lower_program(program, "SM8650")
    assert harness.delegate_count(compiled.edge) == 1
    outputs = compiled.run([x, target])
    reference = models.autograd_reference(model, (x, target), program)
    names = fidelity.output_names(program)
    got = fidelity.Metrics.of(
        outputs[names.index("conv.weight")], reference[names.index("conv.weight")]
    )
    assert got.rel_l2 < 2e-3, got


def _padded_conv() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Conv2d(16, 16, 2, padding=2, groups=16, bias=False).eval(), torch.randn(1, 16, 6, 6)


@pytest.mark.htp
@pytest.mark.xfail(
    strict=True,
    reason="the HTP computes a convolution whose padding reaches "
    "its kernel's extent wrongly (QAIRT 2.51: relative L2 16)",
)
def test_executorch_lowers_a_convolution_whose_padding_reaches_its_kernel_right(qnn_sdk):
    """Canary (plugin off): XPASSes when QAIRT computes this convolution right."""
    from qnn_convbwd.toolchain import harness

    module, x = _padded_conv()
    assert not qnn_convbwd.is_enabled()
    out = harness.lower_module(module, (x,), "SM8650").run([x])[0]
    assert fidelity.Metrics.of(out, module(x).detach()).rel_l2 < 1e-2


@pytest.mark.htp
def test_a_forward_convolution_whose_padding_reaches_its_kernel_stays_on_cpu(qnn_sdk):
    from qnn_convbwd.toolchain import harness

    module, x = _padded_conv()
    program = torch.export.export(module, (x,), strict=True)
    report = qnn_convbwd.decide(program, harness.compile_specs("SM8650"))
    assert [c.rule for c in report.on_cpu] == ["convolution_padding_reaches_kernel"], report.on_cpu
    with qnn_convbwd.enabled():
        compiled = harness.lower_module(module, (x,), "SM8650")
    assert harness.delegate_count(compiled.edge) == 0
    out = compiled.run([x])[0]
    assert fidelity.Metrics.of(out, module(x).detach()).rel_l2 < 1e-5
