"""Gradients through a frozen pt2e-quantized backbone: the straight-through estimator
(``qnn_convbwd.quantized``, ``passes.straight_through``, docs/quantized.md).

Without the simulator: the fake quantize's forward is the quantize / dequantize pair's,
bit for bit; its mask is ``quantized.straight_through_bounds``' interval, exactly; the
joint graph's rewrite back to quantize / dequantize pairs keeps every value of the
program. With it: ExecuTorch's CIFAR model quantized 8a8w in two pieces, a trainable
1x1 convolution on the input and a per-channel scale and bias between the first block
and the rest (``qnn_convbwd_dev.quantized_ste``), lowered for SM8650 into one delegate
and trained three SGD steps beside torch running the same module with the estimator.
"""

from __future__ import annotations

import collections
import copy
import functools

import pytest
import quantized_lowering
import torch
import torchao.quantization.pt2e  # noqa: F401  registers torch.ops.quantized_decomposed
from torch import nn

from qnn_convbwd import quantized, training
from qnn_convbwd.passes import straight_through

q_op = torch.ops.quantized_decomposed.quantize_per_tensor.default
dq_op = torch.ops.quantized_decomposed.dequantize_per_tensor.default

RANGES = list(quantized.RANGE_DTYPES.items())
STEPS = 3
LR = 0.05


def _samples(scale: float, zero_point: int, low: int, high: int, gen) -> torch.Tensor:
    """Random values over the range and beyond, every half step (ties) and every step."""
    spread = torch.randn(4096, generator=gen) * scale * (high - low) / 3
    steps = torch.arange(low - 4, high + 5, dtype=torch.float32) - zero_point
    return torch.cat([spread, steps * scale, (steps + 0.5) * scale])


@pytest.mark.parametrize(("bounds", "dtype"), RANGES, ids=[str(d) for _, d in RANGES])
def test_straight_through_quantize_is_the_pair_bit_for_bit(bounds, dtype):
    low, high = bounds
    gen = torch.Generator().manual_seed(high)
    for _ in range(50):
        scale = float(torch.rand(1, generator=gen)) * 0.1 + 1e-4
        zero_point = int(torch.randint(low, high + 1, (1,), generator=gen))
        x = _samples(scale, zero_point, low, high, gen)
        parameters = (scale, zero_point, low, high, dtype)
        pair = dq_op(q_op(x, *parameters), *parameters)
        ours = quantized.straight_through_quantize(
            x, *parameters, *quantized.straight_through_bounds(scale, zero_point, low, high)
        )
        assert torch.equal(pair, ours), (scale, zero_point)


def test_torchs_fake_quantize_differs_from_the_pair_at_ties():
    """Why the estimator is an op of its own: torch's fake quantize rounds some ties the
    other way (docstring of ``qnn_convbwd.quantized``)."""
    scale, zero_point = 0.07687490115165711, 169
    ties = (torch.arange(-10, 300, dtype=torch.float32) - zero_point + 0.5) * scale
    pair = dq_op(
        q_op(ties, scale, zero_point, 0, 255, torch.uint8), scale, zero_point, 0, 255, torch.uint8
    )
    fake = torch.fake_quantize_per_tensor_affine(ties, scale, zero_point, 0, 255)
    assert int((pair != fake).sum()) == 110


@pytest.mark.parametrize(("bounds", "dtype"), RANGES, ids=[str(d) for _, d in RANGES])
def test_straight_through_bounds_are_torchs_mask(bounds, dtype):
    low, high = bounds
    gen = torch.Generator().manual_seed(high + 1)
    for _ in range(50):
        scale = float(torch.rand(1, generator=gen)) * 0.1 + 1e-5
        zero_point = int(torch.randint(low, high + 1, (1,), generator=gen))
        lo, hi = quantized.straight_through_bounds(scale, zero_point, low, high)
        around = torch.tensor([lo, hi]).view(torch.int32)
        neighbours = (around[:, None] + torch.arange(-3, 4)).flatten().view(torch.float32)
        x = torch.cat([_samples(scale, zero_point, low, high, gen), neighbours])
        _, mask = torch.ops.aten.fake_quantize_per_tensor_affine_cachemask.default(
            x, scale, zero_point, low, high
        )
        assert torch.equal(mask, (x >= lo) & (x <= hi)), (scale, zero_point)


class _Pairs(nn.Module):
    """A trainable scale, then quantize / dequantize pairs around a relu, as pt2e writes
    them."""

    def __init__(self, second=(0.02, 3, 0, 255, torch.uint8)) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.tensor(1.5))
        self.second = second

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = dq_op(
            q_op(x * self.gain, 0.05, 128, 0, 255, torch.uint8), 0.05, 128, 0, 255, torch.uint8
        )
        y = torch.relu(y)
        return dq_op(q_op(y, 0.02, 3, 0, 255, torch.uint8), *self.second)


def _traced(module: nn.Module) -> torch.fx.GraphModule:
    return torch.fx.symbolic_trace(module)


def _pair_values(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """``_Pairs``'s intermediate values on ``x`` (gain 1.5), each pair's in-range mask."""
    with torch.no_grad():
        inner = x * 1.5
        lo1, hi1 = quantized.straight_through_bounds(0.05, 128, 0, 255)
        first = dq_op(q_op(inner, 0.05, 128, 0, 255, torch.uint8), 0.05, 128, 0, 255, torch.uint8)
        mid = torch.relu(first)
        lo2, hi2 = quantized.straight_through_bounds(0.02, 3, 0, 255)
    return {
        "first": first,
        "inside1": (inner >= lo1) & (inner <= hi1),
        "inside2": (mid >= lo2) & (mid <= hi2),
    }


def test_straight_through_keeps_values_and_passes_masked_gradients():
    module = _traced(_Pairs())
    x = torch.randn(256) * 4
    before = module(x)
    assert quantized.straight_through(module) == 2
    assert not quantized.holds_activation_pairs(module)
    after = module(x)
    assert torch.equal(before, after)
    after.sum().backward()
    # d/dgain of fq2(relu(fq1(g x))) with the estimator: x where both pass (torch's
    # fake quantize has the same backward).
    v = _pair_values(x)
    passes = v["inside1"] & (v["first"] > 0) & v["inside2"]
    expected = (x * passes).sum()
    assert 0 < int(passes.sum()) < x.numel(), "the samples should clamp some and pass some"
    assert torch.allclose(module.gain.grad, expected, rtol=1e-6), (module.gain.grad, expected)


def test_clamped_elements_and_the_htps_estimator():
    """``quantized_ste.clamped_elements`` counts each pair's elements beyond its range;
    ``stored_value_reference`` passes the gradient there (as the HTP's estimator, reading
    the stored value, does), where torch's reference zeroes it."""
    from qnn_convbwd_dev import quantized_ste as qs

    module = _traced(_Pairs())
    x = torch.randn(256, generator=torch.Generator().manual_seed(3)) * 4
    v = _pair_values(x)
    beyond = [int((~v["inside1"]).sum()), int((~v["inside2"]).sum())]
    assert all(beyond), beyond  # the samples clamp at both pairs
    assert sorted(qs.clamped_elements(module, x).values()) == sorted(beyond)
    assert not any(qs.clamped_elements(module, x.clamp(-1, 1) / 8).values())
    passing = qs.stored_value_reference(module)
    assert torch.equal(passing(x), module(x))
    passing(x).sum().backward()
    # Every estimator passes: only the relu's mask is left.
    expected = (x * (v["first"] > 0)).sum()
    assert torch.allclose(passing.gain.grad, expected, rtol=1e-6), (passing.gain.grad, expected)
    torchs = qs.reference(module)
    torchs(x).sum().backward()
    assert not torch.allclose(torchs.gain.grad, expected, rtol=1e-3)


def test_straight_through_refuses_a_pair_with_two_parameters():
    module = _traced(_Pairs(second=(0.03, 3, 0, 255, torch.uint8)))
    graph = str(module.graph)
    with pytest.raises(quantized.StraightThroughError, match="other parameters"):
        quantized.straight_through(module)
    assert str(module.graph) == graph, "nothing changes when a pair is refused"


class _Wide(nn.Module):
    """QnnQuantizer's 16-bit activations: an int32 tensor over [0, 65535]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dq_op(
            q_op(x, 1e-4, 30000, 0, 65535, torch.int32), 1e-4, 30000, 0, 65535, torch.int32
        )


def test_sixteen_bit_activations_in_int32_are_taken():
    module = _traced(_Wide())
    x = torch.randn(512)
    before = module(x)
    assert quantized.straight_through(module) == 1
    assert torch.equal(module(x), before)


def test_the_joint_graph_rewrite_keeps_every_value():
    """``lower_fake_quantizes`` on the joint graph: no straight-through op left, the pairs
    with their integer dtype; the program's loss and gradient equal those of the program
    with the op, bit for bit."""
    module = _traced(_Pairs())
    quantized.straight_through(module)
    x = torch.randn(64) * 4
    joint = training.export_joint(_Sum(module), (x,))
    expected = _run(joint, x)
    rewritten = straight_through.lower_fake_quantizes(copy.deepcopy(joint))
    graph = rewritten.graph
    assert not straight_through.fake_quantize_nodes(rewritten)
    quantizes = [n for n in graph.nodes if n.target == q_op]
    assert [n.args[5] for n in quantizes] == [torch.uint8, torch.uint8]
    selects = [n for n in graph.nodes if n.target == torch.ops.aten.where.self]
    assert len(selects) == 3  # the estimator's two, the relu's
    got = _run(rewritten, x)
    for ours, theirs in zip(got, expected, strict=True):
        assert torch.equal(ours, theirs)


def _run(program: torch.export.ExportedProgram, *inputs) -> list[torch.Tensor]:
    """Every output of ``program``'s graph (the loss, then the gradients)."""
    from torch.export.graph_signature import InputKind

    values = {**program.state_dict, **program.constants}
    flat = []
    user = iter(inputs)
    for spec in program.graph_signature.input_specs:
        flat.append(next(user) if spec.kind == InputKind.USER_INPUT else values[spec.target])
    return list(program.graph_module(*flat))


class _Sum(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).sum()


class _Adapted(nn.Module):
    """conv -> (y + adapter(y)) -> relu -> conv: a residual adapter inside a backbone."""

    def __init__(self) -> None:
        super().__init__()
        from qnn_convbwd import finetune

        self.first = finetune.ResidualAdapter(nn.Conv2d(3, 4, 3, padding=1), 4)
        self.relu = nn.ReLU()
        self.last = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.relu(self.first(x)))


def test_float_nodes_are_the_adapter_and_its_residual_join():
    """``quantized.float_nodes``: the adapter's convolution and the residual add of its
    parent, which reads it; not the wrapped block, nor what follows the join."""
    exported = torch.export.export(_Adapted().eval(), (torch.zeros(1, 3, 8, 8),), strict=True)
    module = exported.module()
    found = quantized.float_nodes(module, ["first.adapter"])
    convolutions = [n for n in module.graph.nodes if n.target == torch.ops.aten.conv2d.default]
    assert len(convolutions) == 3
    adds = [n for n in module.graph.nodes if n.target == torch.ops.aten.add.Tensor]
    assert found == [convolutions[1], *adds], [n.name for n in found]
    with pytest.raises(quantized.QuantizationError, match="first.missing"):
        quantized.float_nodes(module, ["first.missing"])


def test_a_float_module_before_a_batch_norm_is_refused():
    """An adapter between a convolution and its batch norm would leave the batch norm
    unfolded between quantized tensors: refused, naming the batch norm."""
    from qnn_convbwd import finetune

    net = nn.Sequential(finetune.ResidualAdapter(nn.Conv2d(3, 4, 3), 4), nn.BatchNorm2d(4))
    module = torch.export.export(net.eval(), (torch.zeros(1, 3, 8, 8),), strict=True).module()
    with pytest.raises(quantized.QuantizationError, match=r"batch norm .*\(1\) reads"):
        quantized.float_nodes(module, ["0.adapter"])


@pytest.mark.htp  # executorch's QnnQuantizer reads the QAIRT version from the SDK's libraries
def test_a_float_adapter_inside_the_backbone_trains_and_the_rest_is_quantized():
    """``quantize_backbone(float_modules=...)``: the adapter's weights stay float and
    require a gradient, the other convolutions' are int8; with the adapter at zero the
    model computes what the backbone quantized without it computes."""
    from qnn_convbwd import finetune

    net = nn.Sequential(_Adapted(), nn.Flatten(), nn.Linear(256, 3)).eval()
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randn(2, 3, 8, 8, generator=gen) for _ in range(3)]
    model = quantized.quantize_backbone(net, "2", "8a8w", batches, ["0.first.adapter"])
    trains = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trains == [
        "2.bias", "2.weight", "backbone.0.first.adapter.bias", "backbone.0.first.adapter.weight",
    ]  # fmt: skip
    assert len(quantized.int8_weights(model)) == 2
    assert isinstance(net[0].first, finetune.ResidualAdapter)
    plain = quantized.quantize_backbone(net, "2", "8a8w", batches)
    with torch.no_grad():
        assert torch.equal(model(batches[0]), plain(batches[0]))


# --- on the simulator ---------------------------------------------------------------------


@functools.cache
def _lowered(soc: str):
    """(model as lowered, the program, the QNN graphs built) for ``soc``."""
    from qnn_convbwd_dev import quantized_ste as qs

    return quantized_lowering.lowered_with_graphs(qs.adapted_cifar("8a8w"), soc)


def _assert_losses_follow_torch(model, program) -> None:
    from qnn_convbwd_dev import quantized_ste as qs

    quantized_lowering.assert_losses_follow_torch(model, program, STEPS, LR, qs.train_both)


@pytest.mark.htp
def test_adapters_on_a_quantized_backbone_are_one_delegate(qnn_sdk):
    """Every node on the HTP, every convolution_backward delegated: the input adapter's
    (grad_weight, grad_bias) and the quantized convolutions' grad_input."""
    from qnn_convbwd.toolchain import harness

    model, program, graphs = _lowered("SM8650")
    assert program.report.on_cpu == [], program.report.on_cpu_markdown()
    assert harness.delegate_count(program.edge) == 1
    assert program.report.rows and all(row.delegated for row in program.report.rows)
    # Built as asked: the quantized weights are no runtime_weight fallback.
    assert program.report.fallbacks == [], program.report.fallbacks
    (ops,) = graphs
    kinds = collections.Counter(op.op_type for op in ops)
    # Three quantized convolutions forward (plus the adapter's); each grad_input that
    # reaches an adapter is a TransposeConv2d on a weight dequantized in the graph.
    assert kinds["Conv2d"] == 4 and kinds["TransposeConv2d"] >= 3, kinds
    # The adapters' outputs are quantized in the delegate: two quantizing copies.
    assert kinds["Quantize"] >= 2, kinds


@pytest.mark.htp
def test_quantized_weights_stay_int8_and_no_float_copy(qnn_sdk):
    """Each quantized weight: the per-channel int8 tensor the forward Conv2d reads, and
    for grad_input its integers once more as an int8 tensor (QNN dequantizes no
    per-channel tensor); no static float tensor of a weight's size."""
    model, program, graphs = _lowered("SM8650")
    (ops,) = graphs
    weights = {
        name: w
        for name, w in model.named_buffers()
        if w.dtype == torch.int8 and w.dim() == 4 and name.startswith(("first.", "rest."))
    }
    assert len(weights) == 3
    sizes = sorted(w.numel() for w in weights.values())
    statics = {t.name: t for op in ops for t in op.inputs if t.is_static}
    one_byte = sorted(t.nbytes for t in statics.values() if t.nbytes in sizes)
    assert one_byte == sorted(sizes * 2), one_byte
    for tensor in statics.values():
        elements = 1
        for d in tensor.dims:
            elements *= d
        assert not (elements in sizes and tensor.nbytes > elements), (
            f"{tensor.name}: {tensor.nbytes} bytes for {elements} elements (a float copy)"
        )


@pytest.mark.htp
def test_three_sgd_steps_follow_the_straight_through_estimator(qnn_sdk):
    model, program, _ = _lowered("SM8650")
    _assert_losses_follow_torch(model, program)


def _lower(model: nn.Module, soc: str):
    from qnn_convbwd.toolchain import harness
    from qnn_convbwd_dev import quantized_backbone as qb

    return training.lower_for_training(
        training.WithLoss(copy.deepcopy(model), nn.functional.cross_entropy),
        qb.batches(1)[0],
        harness.compile_specs(soc),
    )


@pytest.mark.htp
@pytest.mark.slow(reason="a QAT run in torch and another CIFAR lowering")
def test_a_qat_converted_backbone_trains_its_adapter_on_the_htp(qnn_sdk):
    """QnnQuantizer(is_qat=True) + prepare_qat_pt2e, three steps of quantization-aware
    training in torch, convert_pt2e: the converted model lowers as a post-training
    quantized one (the same program: one delegate, nothing on CPU) and its input adapter
    and head train on the simulator as torch trains them."""
    from qnn_convbwd.toolchain import harness
    from qnn_convbwd_dev import quantized_ste as qs

    model = qs.qat_cifar("8a8w")
    program = _lower(model, "SM8650")
    assert program.report.on_cpu == [], program.report.on_cpu_markdown()
    assert harness.delegate_count(program.edge) == 1
    _assert_losses_follow_torch(model, program)


@pytest.mark.htp
@pytest.mark.slow(reason="another CIFAR lowering and CPU steps")
def test_below_v69_the_adapters_train_on_cpu(qnn_sdk):
    """SM8350 (V68): the training graph stays on CPU as a whole; the estimator's quantize /
    dequantize pairs were folded away there (executorch's FoldQDQ), so the program
    computes the backbone's activations in float: its losses stay within the bound of
    torch's with the estimator."""
    from qnn_convbwd.toolchain import harness
    from qnn_convbwd_dev import quantized_ste as qs

    model = qs.adapted_cifar("8a8w")
    program = _lower(model, "SM8350")
    assert harness.delegate_count(program.edge) == 0
    # The convolution_backwards by their own rule, every other node by the graph's.
    rules = {op.rule for op in program.report.on_cpu}
    assert rules == {"training_graph_below_v69", "htp_arch_supported"}, rules
    _assert_losses_follow_torch(model, program)


@pytest.mark.htp
@pytest.mark.slow(reason="three lowerings and simulator steps of one-layer quantized models")
@pytest.mark.parametrize(("kernel", "dtype"), [(3, "16a8w"), (2, "16a8w"), (2, "8a8w")])
def test_an_input_adapters_gradient_crosses_a_padded_quantized_max_pool(kernel, dtype):
    """executorch's RecomposePadMaxPool2d pads the pool's quantized input explicitly, so
    its indices count in the padded plane; the backward reads that input through a
    dequantizing copy, and must still find the plane (``geometry.pool.index_plane``):
    the input adapter's gradient is torch's.

    Judged on a batch inside the calibrated ranges (checked: no element clamps), since
    beyond them the HTP's estimator passes a gradient torch's zeroes ("Clamped gradients
    on the HTP" in docs/quantized.md). On the batch itself kernel 2's average pool clamps
    one channel of one image, which alone moves the adapter's gradient to cosine 0.975
    against torch's reference; there the program's gradient is torch's with the HTP's
    estimator (``stored_value_reference``: cosine 0.99997)."""
    from qnn_convbwd_dev import quantized_backbone as qb
    from qnn_convbwd_dev import quantized_ste as qs

    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(kernel, 2, 1),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10),
    ).eval()  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    calibration = [torch.randn(8, 3, 32, 32, generator=gen) for _ in range(4)]
    model = qs.InputAdapted(quantized.quantize_backbone(net, "5", dtype, calibration))
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name.startswith("input_adapter."))
    data = qb.batches(2)
    x, y = data[1]
    inside = (x * 0.75, y)
    clamped = qs.clamped_elements(model, inside[0])
    assert clamped and not any(clamped.values()), clamped
    lowered = qb.lower(model, data[0], "SM8650")
    assert lowered.delegates == 1 and not lowered.on_cpu
    agreement = qs.gradient_agreement(model, lowered.program, inside)
    for name, (cosine, ratio) in agreement.items():
        assert cosine > 0.99 and abs(ratio - 1) < 0.05, (name, cosine, ratio)
    # On the batch itself (clamped elements included) the HTP's estimator is the judge.
    as_htp = qs.stored_value_reference(model)
    for name, (cosine, ratio) in qs.gradient_agreement(
        model, lowered.program, data[1], as_htp
    ).items():
        assert cosine > 0.999 and abs(ratio - 1) < 0.01, (name, cosine, ratio)


@pytest.mark.parametrize(
    ("model", "adapters"), [("cifar", ("input", "between")), ("resnet18", ("input",))]
)
def test_trained_builds_only_the_adapters_inside_a_torchvision_model(model, adapters):
    from qnn_convbwd_dev import quantized_ste as qs

    with pytest.raises(ValueError, match=f"{model} with adapters .*'inside' adapters only"):
        qs.build(model, "8a8w", adapters, trained=True)
