"""Numerics: the fidelity verdict, eval-mode batch norm, static loss scaling.

HTP tests judge the simulator against torch's own fp16 step or forward (the
floor), per tensor, with ``qnn_convbwd_dev.fidelity``; docs/numerics.md has the
measured tables.
"""

from __future__ import annotations

import functools

import pytest
import torch
from tiers import sweep
from torch import nn

import qnn_convbwd
from qnn_convbwd_dev import fidelity, models
from qnn_convbwd_dev import numerics_models as nm

# --- fidelity: metrics and verdict (no SDK) -----------------------------------------


def test_metrics_of_a_scaled_and_an_orthogonal_tensor():
    b = torch.tensor([3.0, -4.0, 0.0])
    scaled = fidelity.Metrics.of(b * 1.01, b)
    assert scaled.rel_l2 == pytest.approx(0.01)
    assert scaled.max_rel == pytest.approx(0.01)
    assert scaled.cosine == pytest.approx(1.0)
    orthogonal = fidelity.Metrics.of(torch.tensor([4.0, 3.0, 0.0]), b)
    assert orthogonal.cosine == pytest.approx(0.0, abs=1e-12)
    assert fidelity.Metrics.of(torch.zeros(3), torch.zeros(3)) == fidelity.Metrics(0, 0, 1)
    assert fidelity.Metrics.of(b, torch.zeros(3)).rel_l2 == float("inf")


def test_a_non_finite_gradient_is_never_within_and_a_non_finite_floor_is_beaten():
    b = torch.tensor([3.0, -4.0, 1.0])
    floor = fidelity.Metrics.of(b * 1.01, b)
    for bad in (float("inf"), float("nan")):
        broken = fidelity.Metrics.of(torch.tensor([3.0, bad, 1.0]), b)
        assert not broken.finite and broken.rel_l2 == float("inf") and broken.cosine == -1.0
        row = fidelity.Row("t", broken, floor)
        assert not row.within and row.why() == "not finite"
        # torch's fp16 step overflowed: any finite HTP gradient beats it, a non-finite one not
        assert fidelity.Row("t", fidelity.Metrics.of(b * 1.3, b), broken).within
        assert not fidelity.Row("t", broken, broken).within
        pooled = fidelity.pooled([fidelity.Report([fidelity.Row("t", floor, broken)])] * 2).rows[0]
        assert pooled.within and not pooled.floor.finite
    table = fidelity.Report([fidelity.Row("t", floor, broken)]).to_markdown()
    assert "| yes (fp16 step not finite) |" in table


def _linear_step():
    graph = models.training_graph("linear", size=6)
    reference = graph.reference()
    return graph, reference, fidelity.fp16_reference(graph.model, graph.inputs, graph.program)


def test_fp16_step_is_the_floor_and_a_perturbed_gradient_is_named():
    graph, reference, fp16 = _linear_step()
    names = fidelity.output_names(graph.program)
    assert names[0] == "loss" and "adapter.weight" in names
    # torch's fp16 step is off by about fp16's roundoff, not zero and not more
    floor = fidelity.assess(graph.program, fp16, reference, fp16)
    assert floor.within
    assert all(0 < r.floor.rel_l2 < 1e-2 for r in floor.rows[1:])

    worse = [t.clone() for t in fp16]
    k = names.index("adapter.weight")
    worse[k] = reference[k] + 10 * (fp16[k] - reference[k]) + 1e-2 * reference[k].abs().max()
    report = fidelity.assess(graph.program, worse, reference, fp16)
    assert not report.within
    assert [o.split(":")[0] for o in report.offending] == ["adapter.weight"]
    table = report.to_markdown()
    assert "| adapter.weight |" in table and "not within fidelity: adapter.weight" in table


def test_cosine_limit_follows_the_rel_l2_factor():
    b = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    noise = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    floor = b + 0.1 * noise * b.norm() / noise.norm()
    twice = b - 0.19 * noise * b.norm() / noise.norm()
    thrice = b + 0.3 * noise * b.norm() / noise.norm()
    row = fidelity.Row("t", fidelity.Metrics.of(twice, b), fidelity.Metrics.of(floor, b))
    assert row.within, row.why()
    row = fidelity.Row("t", fidelity.Metrics.of(thrice, b), fidelity.Metrics.of(floor, b))
    assert not row.within and "rel_l2" in row.why() and "cosine" in row.why()


def test_pooled_report_judges_each_tensors_errors_over_inputs():
    def report(htp: float, floor: float) -> fidelity.Report:
        cos = 1 - htp**2 / 2, 1 - floor**2 / 2  # errors orthogonal to the reference
        return fidelity.Report(
            [
                fidelity.Row(
                    "t", fidelity.Metrics(htp, htp, cos[0]), fidelity.Metrics(floor, floor, cos[1])
                )
            ]
        )

    # fp16's error on one input is a draw: lucky on the first, unlucky on the second
    lucky, unlucky = report(0.12, 0.036), report(0.10, 0.30)
    assert not lucky.within and unlucky.within
    pooled = fidelity.pooled([lucky, unlucky])
    (row,) = pooled.rows
    assert row.htp.rel_l2 == pytest.approx(((0.12**2 + 0.10**2) / 2) ** 0.5)
    assert row.floor.rel_l2 == pytest.approx(((0.036**2 + 0.30**2) / 2) ** 0.5)
    assert 1 - row.htp.cosine == pytest.approx((0.12**2 + 0.10**2) / 4)
    assert row.htp.max_rel == 0.12 and pooled.within
    # a lowering worse than fp16 on every input stays outside when pooled
    assert not fidelity.pooled([report(0.3, 0.1), report(0.25, 0.1)]).within
    with pytest.raises(ValueError):
        fidelity.pooled([])


class _ReluNet(nn.Module):
    """Linear, ReLU, Linear, MSE; the hidden pre-activations are ``margin`` exactly."""

    def __init__(self, margin: float) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.hidden = nn.Linear(8, 16)
        self.out = nn.Linear(16, 4)
        with torch.no_grad():
            self.hidden.weight.copy_(torch.randn(16, 8, generator=g))
            self.out.weight.copy_(torch.randn(4, 16, generator=g))
        self.x = torch.randn(1, 8, generator=g)
        with torch.no_grad():  # every hidden unit sits at `margin` for the input self.x
            self.hidden.bias.copy_(margin - (self.x @ self.hidden.weight.T)[0])

    def forward(self, x, target):
        h = torch.relu(self.hidden(x))
        return nn.functional.mse_loss(self.out(h), target)


def _relu_step(margin: float):
    from torch.export.experimental import _export_forward_backward

    model = _ReluNet(margin)
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith("bias"))
    inputs = (model.x.clone(), torch.randn(1, 4, generator=torch.Generator().manual_seed(1)))
    joint = _export_forward_backward(torch.export.export(model, inputs, strict=True))
    reference = models.autograd_reference(model, inputs, joint)
    fp16 = fidelity.fp16_reference(model, inputs, joint)
    return fidelity.assess(joint, fp16, reference, fp16), fidelity.input_spread(
        model, inputs, joint
    )


def test_input_spread_is_large_where_relu_masks_flip_with_the_last_bit():
    # hidden units at a margin of 1: a move of one fp16 rounding changes nothing
    report, spread = _relu_step(margin=1.0)
    assert report.ill_conditioned(spread) == []
    assert max(spread) < 8 * fidelity.UNIT_ROUNDOFF
    # at a margin of 1e-4 the masks flip with the input's last bit (it moves the
    # pre-activations by ~1e-3): hidden.bias's gradient is a draw
    report, spread = _relu_step(margin=1e-4)
    names = [r.name for r in report.rows]
    assert spread[names.index("hidden.bias")] > 0.1


def test_ill_conditioned_names_tensors_whose_spread_exceeds_their_limit():
    b = torch.randn(100, generator=torch.Generator().manual_seed(0))
    floor = fidelity.Metrics.of(b * 1.01, b)  # limit 2 * 0.01 + 1e-3
    report = fidelity.Report([fidelity.Row(n, floor, floor) for n in ("loss", "a", "b")])
    assert report.ill_conditioned([0.0, 0.02, 0.03]) == ["b"]
    with pytest.raises(ValueError, match="2 spreads for 3 tensors"):
        report.ill_conditioned([0.0, 0.0])


def test_neighbours_move_each_float_input_by_at_most_one_fp16_rounding():
    x, labels = torch.randn(2, 8), torch.tensor([3, 1])
    found = fidelity.neighbours((x, labels), 4, seed=5)
    assert len(found) == 4 and found[0][0] is x
    for moved, same in found[1:]:
        assert same is labels
        assert not torch.equal(moved, x)
        assert ((moved - x).abs() <= x.abs() * fidelity.UNIT_ROUNDOFF).all()
    again = fidelity.neighbours((x, labels), 4, seed=5)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(found, again))
    with pytest.raises(ValueError, match="at least 1"):
        fidelity.neighbours((x,), 0)


def test_pooled_over_neighbours_tells_fp16_noise_from_a_defect():
    """An ill-conditioned step (ReLU margins 1e-4): a stand-in lowering whose only
    error is rounding its inputs to fp16 fails some neighbours alone, and is within
    pooled over 16; one that also scales the bias gradients by 1.05 is not."""
    from torch.export.experimental import _export_forward_backward

    model = _ReluNet(1e-4)
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith("bias"))
    inputs = (model.x.clone(), torch.randn(1, 4, generator=torch.Generator().manual_seed(1)))
    joint = _export_forward_backward(torch.export.export(model, inputs, strict=True))
    noise, defect = [], []
    for moved in fidelity.neighbours(inputs, 16):
        reference = models.autograd_reference(model, moved, joint)
        floor = fidelity.fp16_reference(model, moved, joint)
        rounded = models.autograd_reference(model, tuple(t.half().float() for t in moved), joint)
        noise.append(fidelity.assess(joint, rounded, reference, floor))
        scaled = [rounded[0], *(t * 1.05 for t in rounded[1:])]
        defect.append(fidelity.assess(joint, scaled, reference, floor))
    assert not all(r.within for r in noise)
    assert fidelity.pooled(noise).within and fidelity.pooled(noise, how="median").within
    assert not any(r.within for r in defect)
    assert not fidelity.pooled(defect).within
    assert not fidelity.pooled(defect, how="median").within


def test_median_pooling_takes_the_typical_draw():
    def report(htp: float, floor: float) -> fidelity.Report:
        return fidelity.Report(
            [
                fidelity.Row(
                    "t",
                    fidelity.Metrics(htp, htp, 1 - htp),
                    fidelity.Metrics(floor, floor, 1 - floor),
                )
            ]
        )

    # one flip lifts the floor's mean square in one draw; off 3x on the other two
    draws = [report(0.03, 0.01), report(0.03, 0.01), report(0.6, 0.6)]
    assert fidelity.pooled(draws).within
    (row,) = fidelity.pooled(draws, how="median").rows
    assert (row.htp.rel_l2, row.floor.rel_l2) == (0.03, 0.01)
    assert row.htp.cosine == pytest.approx(0.97)
    assert not fidelity.pooled(draws, how="median").within
    with pytest.raises(ValueError, match="how must be"):
        fidelity.pooled(draws, how="mean")


# --- batch norm: the rewrite's structure (no SDK) ---------------------------------


def _edge(module: nn.Module, inputs: tuple):
    from executorch.exir import to_edge

    return to_edge(torch.export.export(module, inputs, strict=True)).exported_program()


def _stem_and_block() -> nn.Module:
    """The first two stages of ``mobilenet_bn`` (4 batch norms, the depthwise one
    strided): the rewrite's structure, at a third of the full model's export time."""
    return nn.Sequential(nm.ConvBN(3, 16, 3, stride=2), nm.MobileBlock(16, 64, 24, 2, se=False))


def test_batch_norm_becomes_elementwise_ops_and_a_trained_weight_stays_a_read():
    from qnn_convbwd.passes.batch_norm import decompose_batch_norm, fold_frozen_statistics

    g = nm.bn_training_graph(train="affine", backbone_fn=_stem_and_block)
    edge = _edge_joint(g.program)
    gm = edge.graph_module
    bn = "aten._native_batch_norm_legit_no_training.default"
    count = sum(str(n.target).startswith(f"<EdgeOpOverload: {bn}") for n in gm.graph.nodes)
    assert count == sum(isinstance(m, nn.BatchNorm2d) for m in g.model.modules()) == 4
    assert decompose_batch_norm(gm, edge) == 4
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert not any(bn in t for t in targets)
    # the trained weight of the first batch norm is read by a reshape, into a mul
    weight = next(n for n in gm.graph.nodes if n.name == "p_backbone_0_1_weight")
    (read,) = weight.users
    assert "view_copy" in str(read.target) and list(read.args[1]) == [1, 16, 1, 1]
    assert all("mul.Tensor" in str(u.target) for u in read.users)
    # the backward's rsqrt(var + eps) of the running statistics becomes a constant
    rsqrt = [n for n in gm.graph.nodes if n.op == "call_function" and "rsqrt" in str(n.target)]
    assert rsqrt
    assert fold_frozen_statistics(gm, edge) > 0
    assert not [n for n in gm.graph.nodes if n.op == "call_function" and "rsqrt" in str(n.target)]
    assert weight.users == {read: None}


def _edge_joint(program):
    from executorch.exir import to_edge

    return to_edge(program).exported_program()


# --- batch norm on the HTP ----------------------------------------------------------

# One channel per (running variance, running mean) case.
BN_CASES = [(v, mu) for mu in (0.0, 100.0) for v in (1.0, 1e-2, 1e-4, 1e-6, 0.0)]


def _single_batch_norm():
    torch.manual_seed(0)
    c = len(BN_CASES)
    bn = nn.BatchNorm2d(c)
    with torch.no_grad():
        bn.running_var.copy_(torch.tensor([v for v, _ in BN_CASES]))
        bn.running_mean.copy_(torch.tensor([mu for _, mu in BN_CASES]))
        bn.weight.copy_(torch.rand(c) + 0.5)
        bn.bias.copy_(torch.randn(c) * 0.1)
    module = nn.Sequential(bn).eval()
    spread = torch.tensor([max(v, 1e-5) ** 0.5 for v, _ in BN_CASES]).view(1, c, 1, 1)
    # inputs exactly representable in fp16: the floor is the batch norm's own rounding
    x = (bn.running_mean.view(1, c, 1, 1) + spread * torch.randn(1, c, 8, 8)).half().float()
    return module, x


def _channel_errors(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (out - ref).abs().amax((0, 2, 3)) / ref.abs().amax((0, 2, 3))


def _fp16_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    import copy

    return copy.deepcopy(module).half()(x.half()).float()


@functools.cache
def _executorch_batch_norm_output() -> torch.Tensor:
    """The single batch norm through executorch's own visitor (plugin off) on SM8650,
    lowered and run once for the canary and the mechanism below."""
    from qnn_convbwd.toolchain import harness

    module, x = _single_batch_norm()
    assert not qnn_convbwd.is_enabled()
    return harness.lower_module(module, (x,), "SM8650").run([x])[0]


@pytest.mark.htp
@pytest.mark.xfail(
    strict=True,
    reason="executorch's op_batch_norm.py hard-codes eps=1e-9 and folds the mean into the bias",
)
def test_executorch_batch_norm_lowering_matches_torch(qnn_sdk):
    """Canary: XPASSes when executorch's own QNN batch norm gets small variances right."""
    module, x = _single_batch_norm()
    ref = module(x).detach()
    out = _executorch_batch_norm_output()
    floor = _channel_errors(_fp16_forward(module, x), ref)
    assert (_channel_errors(out, ref) <= 2 * floor + 1e-3).all()


@pytest.mark.htp
def test_executorch_batch_norm_uses_eps_1e_9(qnn_sdk):
    """The mechanism: executorch's output is w / sqrt(var + 1e-9) * x + (b - ... * mean)."""
    module, x = _single_batch_norm()
    bn = module[0]
    out = _executorch_batch_norm_output()
    scale = (bn.weight / torch.sqrt(bn.running_var + 1e-9)).detach()
    emulated = (x - bn.running_mean.view(1, -1, 1, 1)) * scale.view(1, -1, 1, 1)
    emulated = emulated + bn.bias.detach().view(1, -1, 1, 1)
    centred = [i for i, (_, mu) in enumerate(BN_CASES) if mu == 0.0]
    # with a zero mean the fold cancels nothing: executorch's output is the 1e-9 formula
    assert (_channel_errors(out, emulated)[centred] < 2e-3).all()
    # and that is 1.25x off torch's at var = 1e-6 (eps = 1e-5)
    assert _channel_errors(out, module(x).detach())[BN_CASES.index((1e-6, 0.0))] > 1.0


@pytest.mark.htp
@pytest.mark.parametrize("soc", sweep(["SM8450"], ["SM8850"]))  # V69; V81 with --slow
def test_plugin_batch_norm_is_at_the_fp16_floor(qnn_sdk, soc):
    from qnn_convbwd.toolchain import harness

    module, x = _single_batch_norm()
    ref = module(x).detach()
    with qnn_convbwd.enabled():
        compiled = harness.lower_module(module, (x,), soc)
    assert harness.delegate_count(compiled.edge) == 1
    errors = _channel_errors(compiled.run([x])[0], ref)
    floor = _channel_errors(_fp16_forward(module, x), ref)
    assert (errors <= 2 * floor + 1e-3).all(), (errors, floor)


@pytest.mark.htp
def test_mobilenet_like_inference_at_1x1_and_2x2_spatial(qnn_sdk):
    from qnn_convbwd.toolchain import harness

    torch.manual_seed(0)
    module = nm.mobilenet_bn()
    nm.calibrate(module, (4, 3, 8, 8))
    x = torch.randn(1, 3, 8, 8)
    ref = module(x).detach()
    floor = fidelity.Metrics.of(_fp16_forward(module, x), ref)
    with qnn_convbwd.enabled():
        compiled = harness.lower_module(module, (x,), "SM8650")
    assert harness.delegate_count(compiled.edge) == 1
    got = fidelity.Metrics.of(compiled.run([x])[0], ref)
    assert got.max_rel <= 2 * floor.max_rel + 1e-3, (got, floor)


@pytest.mark.htp
@pytest.mark.parametrize(
    "train",
    sweep(
        ["affine"],
        ["bias"],
        reason="the same rewrite with only the bias trained; 'affine' trains the weight too",
    ),
)
def test_mobilenet_like_batch_norm_training_step_is_within_fidelity(qnn_sdk, train):
    from qnn_convbwd.toolchain import harness

    graph = nm.bn_training_graph(train=train)
    compiled = harness.lower_program(graph.program, "SM8650")
    assert harness.delegate_count(compiled.edge) == 1
    outputs = compiled.run(list(graph.inputs))
    report = fidelity.assess_model(graph.model, graph.inputs, graph.program, outputs)
    assert report.within, report.to_markdown()


# --- static loss scaling --------------------------------------------------------------


@pytest.mark.htp
def test_loss_scale_recovers_gradients_that_underflow_in_fp16(qnn_sdk):
    from qnn_convbwd.meta import UNSCALE
    from qnn_convbwd.toolchain import harness

    graph = nm.small_loss_graph(1e-5)
    reference = models.autograd_reference(graph.model, graph.inputs, graph.program)
    with qnn_convbwd.enabled():
        plain = harness.lower_program(graph.program, "SM8650").run(list(graph.inputs))
    # unscaled, the adapter's gradients are flushed to zero entirely
    assert fidelity.Metrics.of(plain[1], reference[1]).rel_l2 == pytest.approx(1.0)

    with qnn_convbwd.enabled(loss_scale=2.0**12):
        compiled = harness.lower_program(graph.program, "SM8650")
    # the unscaling multiplications stay outside the delegate, one per gradient
    cpu = [n for n in compiled.edge.exported_program().graph.nodes if n.meta.get(UNSCALE)]
    assert len(cpu) == len(reference) - 1
    outputs = compiled.run(list(graph.inputs))
    scaled = fidelity.assess_model(graph.model, graph.inputs, graph.program, outputs, 2.0**12)
    assert scaled.within, scaled.to_markdown()
    assert all(r.htp.rel_l2 < 1e-2 for r in scaled.rows), scaled.to_markdown()


def test_loss_scale_must_be_a_finite_float16():
    for bad in (0.0, -1.0, 2.0**16, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="loss_scale"):
            qnn_convbwd.options.Options(loss_scale=bad)
    assert qnn_convbwd.options.Options(loss_scale=2.0**15).loss_scale == 32768


@pytest.mark.htp
def test_fidelity_command_prints_the_table_and_its_verdict(qnn_sdk, capsys):
    from qnn_convbwd import cli

    assert cli.main(["fidelity", "--graph", "small-loss", "--loss-scale", "4096"]) == 0
    out = capsys.readouterr().out
    assert "| model.adapter.weight |" in out and "within fidelity (7 tensors)" in out
    assert cli.main(["fidelity", "--graph", "bn-bias", "--neighbours", "3"]) == 0
    out = capsys.readouterr().out
    assert "over the input and 2 neighbours" in out and "within alone: 3 of 3" in out
    assert "medians: within fidelity (13 tensors)" in out
