"""passes.conv_batch_norm: eval-mode batch norm folded into the frozen convolution before it."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import qnn_convbwd
from qnn_convbwd_dev import fidelity
from qnn_convbwd_dev import numerics_models as nm

BN = "aten._native_batch_norm_legit_no_training.default"


def _stem_and_block() -> nn.Module:
    """4 convolution + batch-norm pairs (one depthwise, strided); the stem reads the input."""
    return nn.Sequential(nm.ConvBN(3, 16, 3, stride=2), nm.MobileBlock(16, 64, 24, 2, se=False))


def _edge(program):
    from executorch.exir import to_edge

    return to_edge(program).exported_program()


def _run(edge, inputs) -> list[torch.Tensor]:
    """The edge program's graph module on torch's kernels, fed its own state."""
    args, user = [], iter(inputs)
    for spec in edge.graph_signature.input_specs:
        kind = spec.kind.name
        if kind in ("PARAMETER", "BUFFER"):
            args.append(edge.state_dict[spec.target])
        elif kind == "CONSTANT_TENSOR":
            args.append(edge.constants[spec.target])
        else:
            args.append(next(user))
    with torch.no_grad():
        return list(edge.graph_module(*args))


def _calls(gm, name: str) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and name in str(n.target)]


def test_frozen_pairs_fold_and_grad_input_reads_the_folded_weight():
    from qnn_convbwd.passes.conv_batch_norm import fold_batch_norms

    graph = nm.bn_training_graph(train="bias", backbone_fn=_stem_and_block)
    edge = _edge(graph.program)
    before = _run(edge, graph.inputs)
    gm = edge.graph_module
    assert len(_calls(gm, BN)) == 4
    backwards = _calls(gm, "convolution_backward")
    assert len(backwards) == 3  # the stem reads the input, which has no gradient
    # autograd's batch-norm backward: grad_output = g * scale
    scaled = {b: (b.args[0], tuple(b.args[0].args)) for b in backwards}
    assert all("mul.Tensor" in str(m.target) for m, _ in scaled.values())

    assert fold_batch_norms(gm, edge) == 4
    assert not _calls(gm, BN)
    for conv in _calls(gm, "aten.convolution.default"):
        weight, bias = conv.args[1:3]
        assert weight.op == "get_attr" and bias.op == "get_attr"
    # each backward reads its forward's folded weight (the same node: stored once),
    # and grad_output without autograd's multiplication by the batch norm's scale
    forward_weights = {c.args[0]: c.args[1] for c in _calls(gm, "aten.convolution.default")}
    for backward in backwards:
        assert backward.args[2] is forward_weights[backward.args[1]]
        assert backward.args[0] in scaled[backward][1]
    # the trained batch-norm biases are added after the folded convolutions, as reads
    for name in [n for n, p in graph.model.named_parameters() if p.requires_grad]:
        placeholder = next(
            n
            for n in gm.graph.nodes
            if n.op == "placeholder" and n.target == f"p_{name.replace('.', '_')}"
        )
        assert all("view_copy" in str(u.target) for u in placeholder.users)

    after = _run(edge, graph.inputs)
    names = fidelity.output_names(graph.program)
    assert len(before) == len(after) == len(names)
    for name, a, b in zip(names, after, before):
        assert fidelity.Metrics.of(a, b).rel_l2 < 1e-5, name


def _contents(container: dict | list) -> list:
    return list(container.values()) if isinstance(container, dict) else list(container)


def test_an_observer_sees_each_folded_weight_and_the_pass_keeps_none():
    """``observe_folds`` hands over, by parameter name, the very values each folded
    convolution stores; outside the block the pass calls no one and keeps nothing."""
    from qnn_convbwd.passes import conv_batch_norm

    graph = nm.bn_training_graph(train="bias", backbone_fn=_stem_and_block)
    edge = _edge(graph.program)
    seen: dict[str, torch.Tensor] = {}
    with conv_batch_norm.observe_folds(seen.__setitem__):
        assert conv_batch_norm.fold_batch_norms(edge.graph_module, edge) == 4
    frozen = {n for n, p in graph.model.named_parameters() if not p.requires_grad}
    assert len(seen) == 4 and set(seen) <= frozen
    stored = [
        getattr(edge.graph_module, c.args[1].target)
        for c in _calls(edge.graph_module, "aten.convolution.default")
    ]
    for name, weight in seen.items():
        assert any(s.shape == weight.shape and torch.equal(s, weight) for s in stored), name
        original = dict(graph.model.named_parameters())[name]
        assert not torch.equal(weight, original)  # the batch norm's scale is in it

    later: dict[str, torch.Tensor] = {}
    again = _edge(nm.bn_training_graph(train="bias", backbone_fn=_stem_and_block).program)
    with conv_batch_norm.observe_folds(later.__setitem__):
        pass
    assert conv_batch_norm.fold_batch_norms(again.graph_module, again) == 4
    assert later == {} and conv_batch_norm._fold_observers == []
    held = [
        name
        for name, value in vars(conv_batch_norm).items()
        if isinstance(value, dict | list)
        and any(isinstance(v, torch.Tensor) for v in _contents(value))
    ]
    assert held == []  # no module-level container of tensors


def test_a_trained_batch_norm_weight_is_not_folded_and_says_why(caplog):
    from qnn_convbwd.passes.conv_batch_norm import fold_batch_norms

    graph = nm.bn_training_graph(train="affine", backbone_fn=_stem_and_block)
    edge = _edge(graph.program)
    with caplog.at_level(logging.INFO, logger="qnn_convbwd.passes.conv_batch_norm"):
        assert fold_batch_norms(edge.graph_module, edge) == 0
    assert len(_calls(edge.graph_module, BN)) == 4
    logger = "qnn_convbwd.passes.conv_batch_norm"
    reasons = [r.getMessage() for r in caplog.records if r.name == logger]
    assert len(reasons) == 4
    assert all(
        "not folded" in r and "the batch-norm weight" in r and "trains" in r for r in reasons
    ), reasons


def _retrained(graph, trains) -> nm.Graph:
    """``graph``'s model with the parameters ``trains(name)`` selects trained, re-exported."""
    from torch.export.experimental import _export_forward_backward

    for name, parameter in graph.model.named_parameters():
        parameter.requires_grad_(trains(name))
    program = torch.export.export(graph.model, graph.inputs, strict=True)
    return nm.Graph(graph.model, graph.inputs, _export_forward_backward(program))


def test_a_trained_convolution_weight_is_not_folded_with_fold_frozen(caplog):
    from qnn_convbwd.passes.conv_batch_norm import fold_batch_norms

    graph = nm.bn_training_graph(train="bias", backbone_fn=_stem_and_block)
    edge = _edge(_retrained(graph, lambda name: True).program)
    with caplog.at_level(logging.INFO, logger="qnn_convbwd.passes.conv_batch_norm"):
        assert fold_batch_norms(edge.graph_module, edge, fold_trained="never") == 0
    assert len(_calls(edge.graph_module, BN)) == 4
    assert any(
        "the convolution weight" in r.getMessage() and "trains" in r.getMessage()
        for r in caplog.records
    )


def _narrow_then_wide() -> nn.Module:
    """At 8 px: a 3 -> 8 3x3 pair (216 weights, 512 outputs), then an 8 -> 32 3x3
    stride-2 pair (2304 weights, 512 outputs)."""
    return nn.Sequential(nm.ConvBN(3, 8, 3), nm.ConvBN(8, 32, 3, stride=2))


def test_a_trained_pair_is_folded_only_where_that_saves_work(caplog):
    """``fold_trained="cheaper"`` (``batch_norm="fold"``): a trained pair is folded on
    the device when the weight-sized ops it adds (4 x 216 with gamma trained) are
    fewer than the activation-sized ones it removes (7 x 512); the wide pair
    (4 x 2304 against 7 x 512) keeps its batch norm and says why; the step is
    unchanged in fp32."""
    from qnn_convbwd.passes.conv_batch_norm import fold_batch_norms

    graph = _retrained(
        nm.bn_training_graph(train="bias", backbone_fn=_narrow_then_wide), lambda name: True
    )
    edge = _edge(graph.program)
    before = _run(edge, graph.inputs)
    gm = edge.graph_module
    with caplog.at_level(logging.INFO, logger="qnn_convbwd.passes.conv_batch_norm"):
        assert fold_batch_norms(gm, edge, fold_trained="cheaper") == 1
    (kept,) = _calls(gm, BN)
    assert kept.args[0].args[1].meta["val"].shape == (32, 8, 3, 3)
    messages = [r.getMessage() for r in caplog.records]
    assert any("adds 9216 weight-sized" in m and "for 3584 activation-sized" in m for m in messages)
    assert len([m for m in messages if "whose weight trains" in m]) == 1, messages
    gm.graph.lint()
    after = _run(edge, graph.inputs)
    for name, a, b in zip(fidelity.output_names(graph.program), after, before, strict=True):
        assert fidelity.Metrics.of(a, b).rel_l2 < 1e-5, name


def test_fold_batch_norms_rejects_an_unknown_fold_trained():
    """The value is checked before anything else: a traced pair and no program."""
    from qnn_convbwd.passes.conv_batch_norm import fold_batch_norms

    traced = torch.fx.symbolic_trace(_narrow_then_wide().eval())
    with pytest.raises(ValueError, match="fold_trained=True"):
        fold_batch_norms(traced, None, fold_trained=True)


@pytest.mark.parametrize(
    ("trains", "zero_gammas"),
    [
        pytest.param(lambda name: True, False, id="full"),
        # half of each batch norm's weights 0: the folded weight's rows are 0 there
        pytest.param(lambda name: True, True, id="full-zero-gammas"),
        # the convolutions and the batch-norm biases: the scale is a constant
        pytest.param(
            lambda name: name.endswith(".0.weight") or name.endswith(".bias"), False, id="conv"
        ),
    ],
)
def test_trained_pairs_fold_on_the_device_and_compute_the_same_step(trains, zero_gammas):
    """Full fine-tuning: the folded weight ``W * s`` is a graph op, each backward reads
    it with grad_output ``g``, and every output (grad_gamma through ``sum(dW' * W)``)
    equals the unfolded graph's in fp32."""
    from qnn_convbwd.passes.conv_batch_norm import fold_batch_norms

    graph = nm.bn_training_graph(train="bias", backbone_fn=_stem_and_block)
    if zero_gammas:
        with torch.no_grad():
            for module in graph.model.modules():
                if isinstance(module, nn.BatchNorm2d):
                    module.weight[::2] = 0.0
    graph = _retrained(graph, trains)
    edge = _edge(graph.program)
    before = _run(edge, graph.inputs)
    gm = edge.graph_module
    assert fold_batch_norms(gm, edge) == 4
    assert not _calls(gm, BN)
    gm.graph.lint()
    convs = _calls(gm, "aten.convolution.default")
    for conv in convs:
        weight = conv.args[1]
        assert "mul.Tensor" in str(weight.target) and weight.args[0].op == "placeholder"
    forward_weights = {c.args[0]: c.args[1] for c in convs}
    backwards = _calls(gm, "convolution_backward")
    assert len(backwards) == 4  # the stem's weight trains
    for backward in backwards:
        assert backward.args[2] is forward_weights[backward.args[1]]
    after = _run(edge, graph.inputs)
    names = fidelity.output_names(graph.program)
    assert len(before) == len(after) == len(names)
    for name, a, b in zip(names, after, before):
        assert torch.isfinite(a).all(), name
        assert fidelity.Metrics.of(a, b).rel_l2 < 1e-5, name


@pytest.mark.htp
def test_folded_bias_only_step_is_one_delegate_and_within_fidelity(qnn_sdk):
    from qnn_convbwd.toolchain import harness

    graph = nm.bn_training_graph(train="bias", backbone_fn=_stem_and_block)
    with qnn_convbwd.enabled(batch_norm="fold"):
        compiled = harness.lower_program(graph.program, "SM8650")
    program = compiled.edge.exported_program()
    assert harness.delegate_count(compiled.edge) == 1
    assert not [n for n in program.graph.nodes if "batch_norm" in str(n.target)]
    outputs = compiled.run(list(graph.inputs))
    report = fidelity.assess_model(graph.model, graph.inputs, graph.program, outputs)
    assert report.within, report.to_markdown()


def _wide_graph():
    """Two frozen 64x64x3x3 convolutions with batch norms that grad_input reads; bias-only."""
    from torch.export.experimental import _export_forward_backward

    torch.manual_seed(0)
    backbone = nn.Sequential(
        nm.ConvBN(3, 64, 3), nm.ConvBN(64, 64, 3, stride=2), nm.ConvBN(64, 64, 3)
    )
    nm.calibrate(backbone, (4, 3, 16, 16))
    model = nm.BiasOnly(backbone, "bias")
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        target = torch.randn_like(backbone(x))
    program = _export_forward_backward(torch.export.export(model, (x, target), strict=True))
    return nm.Graph(model, (x, target), program)


@pytest.mark.htp
def test_a_folded_weight_is_stored_once(qnn_sdk):
    """The forward convolution and grad_input read one folded constant: the context is
    smaller than the unfolded graph's, which stores each weight once and adds batch norms.
    (Measured, SM8650: folded 246,016 bytes, unfolded 291,072; without
    ``passes.shared_constants`` the fold stored the weights twice: 381,184.)"""
    from qnn_convbwd.toolchain import harness

    graph = _wide_graph()
    sizes = {}
    for mode in ("decompose", "fold"):
        with qnn_convbwd.enabled(batch_norm=mode):
            compiled = harness.lower_program(graph.program, "SM8650")
        assert harness.delegate_count(compiled.edge) == 1
        sizes[mode] = compiled.context_binary_bytes
        report = fidelity.assess_model(
            graph.model, graph.inputs, graph.program, compiled.run(list(graph.inputs))
        )
        assert report.within, (mode, report.to_markdown())
    weight_bytes = 64 * 64 * 9 * 2  # fp16
    assert sizes["fold"] < sizes["decompose"], sizes
    assert sizes["decompose"] - sizes["fold"] < weight_bytes, sizes


@pytest.mark.htp
def test_a_folded_program_trains_with_executorchs_training_runtime(qnn_sdk):
    """TrainingModule loads the folded program, every trained batch-norm bias (added
    after its folded convolution as a read of the parameter) gets its SGD updates, and
    the steps follow torch's."""
    _trains_beside_torch(_wide_graph(), trained_count=3)


def _trains_beside_torch(graph, trained_count: int) -> None:
    """3 SGD steps of ``graph``'s program with TrainingModule next to torch's: every
    trained parameter returned and updated, the losses and updates following torch's."""
    from qnn_convbwd import api, training
    from qnn_convbwd.toolchain import harness

    result = api.lower(graph.program, harness.compile_specs("SM8650"))
    assert harness.delegate_count(result.edge) == 1
    pte = result.edge.to_executorch().buffer
    # raises when a trained parameter is not returned by the program
    run = training.train_side_by_side(pte, graph.model, list(graph.inputs), 3, 0.05)
    trained = [n for n, p in graph.model.named_parameters() if p.requires_grad]
    assert sorted(run.updates) == sorted(trained) and len(trained) == trained_count
    assert all(float(ours.abs().max()) > 0 for ours, _ in run.updates.values())
    assert run.worst_loss_gap() < 1e-3, [(s.loss, s.reference_loss) for s in run.steps]
    assert run.update_cosine() > 0.999, run.update_cosine()


@pytest.mark.htp
def test_a_fully_trained_folded_step_is_within_fidelity_and_closer_to_fp32(qnn_sdk, caplog):
    """Every weight trains: folded on the device (``"fold_device"``) the step is within
    fidelity and its loss closer to fp32 than with the batch norms element-wise
    (``"fold_frozen"``; the default ``"fold"`` keeps these 64-channel pairs element-wise,
    where the fold would add more element operations than it saves).
    (Measured, SM8650: loss relative error 1.9e-4 folded, 3.1e-4 element-wise, torch
    fp16 9.6e-5; every gradient's relative L2 smaller folded.)"""
    from qnn_convbwd.toolchain import harness

    graph = _retrained(_wide_graph(), lambda name: True)
    loss_error = {}
    for mode in ("fold_device", "fold_frozen"):
        caplog.clear()
        with (
            qnn_convbwd.enabled(batch_norm=mode),
            caplog.at_level(logging.INFO, logger="qnn_convbwd.passes.conv_batch_norm"),
        ):
            compiled = harness.lower_program(graph.program, "SM8650")
        folded = [r for r in caplog.records if "whose weight trains" in r.getMessage()]
        assert len(folded) == (3 if mode == "fold_device" else 0), [r.getMessage() for r in folded]
        assert harness.delegate_count(compiled.edge) == 1
        program = compiled.edge.exported_program()
        assert not [n for n in program.graph.nodes if "batch_norm" in str(n.target)]
        outputs = compiled.run(list(graph.inputs))
        report = fidelity.assess_model(graph.model, graph.inputs, graph.program, outputs)
        if mode == "fold_device":
            assert report.within, report.to_markdown()
        loss_error[mode] = report.rows[0].htp.rel_l2
    assert loss_error["fold_device"] < loss_error["fold_frozen"], loss_error


@pytest.mark.htp
@pytest.mark.parametrize("mode", ["fold", "fold_device"])
def test_a_fully_trained_folded_program_trains_with_executorchs_training_runtime(qnn_sdk, mode):
    """TrainingModule loads the program whose folded weights are computed on the device
    from the trained parameters (``"fold_device"``: all three pairs; the default
    ``"fold"``: the 3 -> 64 stem, the two 64 -> 64 pairs element-wise), and every
    weight, batch-norm weight and bias gets its SGD updates, following torch's steps
    (measured with ``"fold_device"``: loss gap 1.9e-4, update cosine 0.99978)."""
    with qnn_convbwd.enabled(batch_norm=mode):
        _trains_beside_torch(_retrained(_wide_graph(), lambda name: True), trained_count=9)
