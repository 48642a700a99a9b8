"""Core lowering of convolution_backward's input gradient.

Numerical tolerance (fp16 HTP): rounding grad_output and the weight to fp16
perturbs each product by at most ~2u (u = 2^-11) and the fp16 result adds u,
so with wider accumulation |error_i| <= ~3u * sum_j |g_j||w_ij|. Tests allow
4u times that element-wise scale (``programs.fp16_error_bound``); the worst
measured ratio over the generated configurations was 2.34.
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
from programs import (
    Config,
    ConvBackwardBank,
    conv_backward_of,
    fp16_error_bound,
    generate_configs,
)
from tiers import sweep
from torch import nn

import qnn_convbwd
from qnn_convbwd.geometry import conv as geo
from qnn_convbwd_dev import models

U_FP16 = 2.0**-11
BOUND_FACTOR = 4.0


# --- enable / disable ------------------------------------------------------------


def _executorch_state():
    from executorch.backends.qualcomm import qnn_preprocess
    from executorch.backends.qualcomm._passes.i64_to_i32 import I64toI32
    from executorch.backends.qualcomm._passes.layout_transform import LayoutTransform
    from executorch.backends.qualcomm._passes.qnn_pass_manager import QnnPassManager
    from executorch.backends.qualcomm.builders import node_visitor_manager
    from executorch.backends.qualcomm.partition import qnn_partitioner

    support = qnn_partitioner.QnnOperatorSupport
    return {
        "build": qnn_preprocess.QnnBackend.__dict__["_build_op_wrappers"],
        "qnn_manager": qnn_preprocess.get_current_qnn_manager,
        "visitors": dict(node_visitor_manager._node_visitor_dict),
        "support_init": support.__dict__["__init__"],
        "is_node_supported": support.__dict__["is_node_supported"],
        "record": I64toI32.__dict__["_record_original_output_dtype"],
        "preserve": I64toI32.__dict__["_preserve_output_dtype"],
        "sensitive": frozenset(LayoutTransform.layout_sensitive_ops),
        "activations": QnnPassManager.__dict__["get_default_pass_activations"],
        "deps": QnnPassManager.__dict__["get_passes_dependency_for_capture_program"],
        "passes": [p for p, _ in QnnPassManager.get_default_pass_activations()],
        "signature_lookups": _signature_lookups(),
    }


def _signature_lookups():
    from executorch.backends.qualcomm.builders import utils

    return (utils.is_param, utils.is_buffer, utils.is_lifted_tensor_constant)


def test_enable_is_idempotent_and_disable_restores_executorch_exactly():
    assert not qnn_convbwd.is_enabled()
    before = _executorch_state()
    qnn_convbwd.enable()
    qnn_convbwd.enable()
    during = _executorch_state()
    assert "aten.convolution_backward.default" in during["visitors"]
    hooks = qnn_convbwd.pipeline.hooks()
    plugin_passes = (
        len(hooks.quantization_passes)
        + len(hooks.transform_passes)
        + len(hooks.late_transform_passes)
    )
    assert len(during["passes"]) == len(before["passes"]) + plugin_passes
    changed = {k for k in before if before[k] != during[k]}
    assert changed == set(before)  # every integration point is in effect
    qnn_convbwd.disable()
    after = _executorch_state()
    assert after == before
    assert all(
        after[k] is before[k]
        for k in before
        if callable(before[k]) or hasattr(before[k], "__func__")
    )


def test_enable_reports_its_side_effects_and_disable_reverts_the_environment(monkeypatch, caplog):
    """enable() says what it did in one INFO line and a record; disable() puts the
    environment variables it set back (here: unset QNN_SDK_ROOT, a sentinel path)."""
    import logging
    import os

    from qnn_convbwd.toolchain import sdk

    assert not qnn_convbwd.is_enabled()
    monkeypatch.delenv("QNN_SDK_ROOT", raising=False)
    monkeypatch.setenv("LD_LIBRARY_PATH", "/sentinel/lib")
    caplog.set_level(logging.INFO, logger="qnn_convbwd.api")
    effects = qnn_convbwd.enable()
    try:
        assert qnn_convbwd.side_effects() is effects
        assert qnn_convbwd.enable() is effects  # idempotent: nothing new happened
        (line,) = [r for r in caplog.records if r.name == "qnn_convbwd.api"]
        assert line.levelno == logging.INFO and line.getMessage() == effects.summary()
        assert effects.patches > 10
        active = sdk.active_sdk()
        if active is None or active.source == "QNN_SDK_ROOT":
            assert effects.environment == {}  # a user's SDK: the environment is theirs
        else:
            assert effects.sdk_root == str(active.root)
            assert effects.environment["QNN_SDK_ROOT"] == (None, str(active.root))
            before, after = effects.environment["LD_LIBRARY_PATH"]
            assert before == "/sentinel/lib" and after.endswith(":/sentinel/lib")
            assert os.environ["QNN_SDK_ROOT"] == str(active.root)
    finally:
        qnn_convbwd.disable()
    assert qnn_convbwd.side_effects() is None
    assert "QNN_SDK_ROOT" not in os.environ
    assert os.environ["LD_LIBRARY_PATH"] == "/sentinel/lib"


def test_enabled_context_restores_prior_state():
    before = _executorch_state()
    with qnn_convbwd.enabled():
        assert qnn_convbwd.is_enabled()
        with qnn_convbwd.enabled():
            assert qnn_convbwd.is_enabled()
        assert qnn_convbwd.is_enabled()  # inner block leaves the outer one enabled
    assert not qnn_convbwd.is_enabled()
    assert _executorch_state() == before


class _WithConstant(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.norm = nn.BatchNorm2d(3)

    def forward(self, x):
        return self.norm(self.conv(x)) * torch.tensor([2.0, 1.0, 0.5]).view(1, 3, 1, 1)


def _signature_program():
    program = torch.export.export(_WithConstant().eval(), (torch.randn(1, 2, 5, 5),))
    kinds = {spec.kind.name for spec in program.graph_signature.input_specs}
    assert {"PARAMETER", "BUFFER", "CONSTANT_TENSOR", "USER_INPUT"} <= kinds
    return program


def test_signature_frozen_answers_as_torch_does_without_rebuilding_the_signature(monkeypatch):
    from executorch.backends.qualcomm.builders import utils
    from torch.export.graph_signature import ExportGraphSignature

    from qnn_convbwd import integration

    program = _signature_program()
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    checks = ("is_parameter", "is_constant", "is_graph_input", "is_mutable_buffer_input")
    with qnn_convbwd.enabled():
        outside = {c: [getattr(utils, c)(n, program) for n in placeholders] for c in checks}
        rebuilt = []
        for name in ("inputs_to_parameters", "inputs_to_buffers"):
            prop = getattr(ExportGraphSignature, name)

            def counting(self, _prop=prop, _name=name):
                rebuilt.append(_name)
                return _prop.fget(self)

            monkeypatch.setattr(ExportGraphSignature, name, property(counting))
        with integration.signature_frozen(program):
            assert rebuilt == ["inputs_to_parameters", "inputs_to_buffers"]  # read on entry
            inside = {c: [getattr(utils, c)(n, program) for n in placeholders] for c in checks}
            # is_mutable_buffer_input reads the signature itself once it knows a buffer (3)
            assert rebuilt == ["inputs_to_parameters"] + ["inputs_to_buffers"] * 4
        monkeypatch.undo()
    assert inside == outside
    assert outside["is_parameter"].count(True) == 8  # 4 parameters, 3 buffers, 1 constant
    assert outside["is_graph_input"].count(True) == 1


def test_signature_frozen_refuses_a_signature_changed_inside_it():
    """A phase that changed the signature under frozen answers is reported, not trusted;
    after the scope the checks read the signature as it is."""
    from executorch.backends.qualcomm.builders import utils

    from qnn_convbwd import integration

    program = _signature_program()
    specs = program.graph_signature.input_specs
    index = next(i for i, spec in enumerate(specs) if spec.kind.name == "PARAMETER")
    node = next(n for n in program.graph.nodes if n.name == specs[index].arg.name)
    with qnn_convbwd.enabled():
        assert utils.is_parameter(node, program)
        removed = specs[index]
        with pytest.raises(integration.ExecutorchIntegrationError, match="signature changed"):
            with integration.signature_frozen(program):
                del specs[index]
                assert utils.is_parameter(node, program)  # the frozen answer
        assert not utils.is_parameter(node, program)  # torch's, from the changed signature
        specs.insert(index, removed)
        assert utils.is_parameter(node, program)


def test_options_name_their_choices():
    from qnn_convbwd import options
    from qnn_convbwd.builders.input_gradient import FORMULATIONS

    assert set(FORMULATIONS) == set(options.INPUT_GRADIENT_FORMULATIONS)
    for field in ("stride", "output_padding", "input_gradient"):
        with pytest.raises(ValueError, match=f"{field}='bogus' is not one of"):
            qnn_convbwd.enable(**{field: "bogus"})
    with pytest.raises(ValueError, match="htp_optimization=1 is not one of 2, 3"):
        qnn_convbwd.enable(htp_optimization=1)
    with pytest.raises(TypeError):
        qnn_convbwd.enable(strides="zero_insert")
    qnn_convbwd.disable()
    assert options.current == options.Options()


# --- geometry: the derived transposed convolution equals aten's grad_input --------


def _qnn_transpose_conv_reference(g, w, plan: geo.TransposedConvPlan) -> torch.Tensor:
    """QNN TransposeConv2d semantics in torch: [upsampled,] full extent, + output_padding,
    crop [, upsampled and cropped (kernel-1 upsampling) or sliced ("crop" plan)]."""

    def upsampled(t):
        up = t.new_zeros(*t.shape[:2], *(n * f for n, f in zip(t.shape[2:], plan.zero_insert)))
        up[(slice(None), slice(None), *(slice(None, None, f) for f in plan.zero_insert))] = t
        return up

    def cropped(t, amounts):
        crops = [slice(None), slice(None)]
        for dim, (begin, end) in enumerate(amounts):
            crops.append(slice(begin, t.shape[2 + dim] - end))
        return t[tuple(crops)]

    if plan.upsamples and not plan.upsample_output:
        g = upsampled(g)
    g = nn.functional.pad(
        g, [x for extra in reversed(plan.grad_output_pad_end) for x in (0, extra)]
    )
    full = nn.functional.conv_transpose2d(g, w, stride=plan.stride, groups=plan.groups)
    full = nn.functional.pad(full, [x for o in reversed(plan.output_padding) for x in (0, o)])
    result = cropped(full, plan.pad_amount)
    if plan.result_slice:
        assert tuple(result.shape[2:]) == plan.full_size
        result = result[(slice(None), slice(None), *(slice(b, e) for b, e in plan.result_slice))]
    return cropped(upsampled(result), plan.output_crop) if plan.upsample_output else result


@pytest.mark.parametrize(
    "mode, stride",
    [(m, "parameter") for m in geo.OUTPUT_PADDING_MODES] + [("auto", "zero_insert")],
)
def test_every_plan_computes_aten_grad_input(mode, stride):
    upsampled = 0
    for config in generate_configs(60, seed=7):
        bank = ConvBackwardBank([config])
        (g,) = bank.example_inputs()
        (expected,) = bank(g)
        conv = conv_backward_of(config)
        plan = geo.plan_input_gradient(conv, mode, stride)
        got = _qnn_transpose_conv_reference(g, bank.weights[0], plan)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=str(config))
        if mode in ("fold", "crop") or plan.upsamples:
            assert not plan.uses_output_padding
        if mode == "crop" and not plan.upsamples:
            assert not any(p for pads in plan.pad_amount for p in pads)
        upsampled += plan.upsamples
    # generate_configs draws strides 1-3: most configs have one > 1.
    assert upsampled > 30 if stride == "zero_insert" else upsampled == 0


def test_odd_input_needs_output_padding_one():
    config = Config(1, 4, 4, (3, 3), (2, 2), (1, 1), 1, (9, 10))  # 9 -> 5 -> 9, 10 -> 5 -> 9
    node = next(
        n
        for n in ConvBackwardBank([config]).export().graph.nodes
        if n.target == torch.ops.aten.convolution_backward.default
    )
    assert geo.parse(node).transposed_output_padding() == (0, 1)


# --- the exported op survives to the partitioner; plain executorch fails --------


def _frozen_stack_graph():
    # No relu: on V68, executorch's lowering of relu's backward mask (le + where) itself
    # fails to compile (QAIRT: "no properties registered for q::Select"), unrelated to us.
    return models.training_graph("linear", size=9, channels=4)


def test_plain_executorch_cannot_lower_a_joint_graph(qnn_sdk):
    from qnn_convbwd.toolchain import harness

    graph = _frozen_stack_graph()
    assert not qnn_convbwd.is_enabled()
    from executorch.backends.qualcomm._passes.qnn_pass_manager import QnnPassManager
    from executorch.backends.qualcomm.partition.qnn_partitioner import QnnPartitioner
    from executorch.backends.qualcomm.utils.utils import qnn_edge_config
    from executorch.exir import to_edge_transform_and_lower

    specs = harness.compile_specs("SM8650")
    manager = QnnPassManager()
    program = manager.transform_for_export_pipeline(graph.program)
    with pytest.raises(Exception, match="I64toI32"):
        to_edge_transform_and_lower(
            program,
            transform_passes=manager.get_to_edge_transform_passes(program),
            partitioner=[QnnPartitioner(specs)],
            compile_config=qnn_edge_config(),
        )


def test_convolution_backward_reaches_the_partitioner_undecomposed(qnn_sdk):
    """On V68 nothing is delegated, so every node must still be in the final graph."""
    from qnn_convbwd.toolchain import harness

    graph = _frozen_stack_graph()
    aten_op = torch.ops.aten.convolution_backward.default
    exported = [n for n in graph.program.graph.nodes if n.target == aten_op]
    result = qnn_convbwd.lower(graph.program, harness.compile_specs("SM8350"))
    edge_op = qnn_convbwd.integration.get("ops").edge.aten.convolution_backward.default
    remaining = [n for n in result.edge.exported_program().graph.nodes if n.target == edge_op]
    assert len(exported) == len(remaining) == 3
    assert all(not row.delegated for row in result.report.rows)


# --- structure of the QNN graph ------------------------------------------------------


class SharedWeightNet(nn.Module):
    """A frozen conv applied twice (two backward nodes on one weight) and a
    stride-2 conv on an even size (output_padding 1, folded into the upsampled crop)."""

    def __init__(self) -> None:
        super().__init__()
        self.adapter = nn.Conv2d(8, 8, 1)
        self.shared = nn.Conv2d(8, 8, 3, padding=1)
        self.down = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.shared.requires_grad_(False)
        self.down.requires_grad_(False)

    def forward(self, x, target):
        y = torch.relu(self.shared(torch.relu(self.shared(self.adapter(x)))))
        return nn.functional.mse_loss(self.down(y), target)


@contextlib.contextmanager
def _capture_uint32_params():
    from qnn_convbwd.builders import qnn_ops

    original_tensor, original_scalar = qnn_ops.uint32_param, qnn_ops.uint32_scalar
    seen: dict[tuple[str, str], object] = {}

    def tensor_param(op, name, values):
        seen[(op.GetOpWrapper().GetName(), name)] = [
            list(v) if isinstance(v, tuple) else v for v in values
        ]
        original_tensor(op, name, values)

    def scalar_param(op, name, value):
        seen[(op.GetOpWrapper().GetName(), name)] = int(value)
        original_scalar(op, name, value)

    qnn_ops.uint32_param, qnn_ops.uint32_scalar = tensor_param, scalar_param
    try:
        yield seen
    finally:
        qnn_ops.uint32_param, qnn_ops.uint32_scalar = original_tensor, original_scalar


def _io(op, which: str):
    return [(t.name, t.kind, list(t.dims)) for t in getattr(op, which)]


@pytest.fixture(scope="module")
def shared_weight_lowering(qnn_sdk):
    from torch.export.experimental import _export_forward_backward

    from qnn_convbwd.toolchain import harness

    torch.manual_seed(0)
    model = SharedWeightNet()
    x = torch.randn(1, 8, 10, 10)
    target = torch.randn(1, 16, 5, 5)
    joint = _export_forward_backward(torch.export.export(model, (x, target), strict=True))
    # The static-weight structure of transpose_conv; runtime_weight (the default)
    # is checked in test_weight_bytes.py.
    # The zero_insert structure of a strided grad_input; "phases" (the default) is
    # checked in test_phases.py.
    with (
        qnn_convbwd.enabled(input_gradient="transpose_conv", stride="zero_insert"),
        qnn_convbwd.integration.capture_qnn_graphs() as graphs,
        _capture_uint32_params() as params,
    ):
        compiled = harness.lower_program(joint, "SM8650")
    return model, (x, target), joint, compiled, graphs, params


def test_forward_and_backward_read_the_same_static_weight(shared_weight_lowering):
    _, _, _, compiled, graphs, _ = shared_weight_lowering
    assert len(graphs) == 1
    ops = graphs[0]
    by_output = {out[0]: op for op in ops for out in _io(op, "outputs")}
    tconvs = [op for op in ops if op.op_type == "TransposeConv2d"]
    convs = [op for op in ops if op.op_type == "Conv2d"]
    assert len(tconvs) == 3  # shared twice + down; the adapter's needs no grad_input
    forward_weights = {_io(op, "inputs")[1][0] for op in convs}
    transposes = {}
    for tconv in tconvs:
        hwoi_name, hwoi_type, hwoi_dims = _io(tconv, "inputs")[1]
        assert hwoi_type == "QNN_TENSOR_TYPE_NATIVE"  # produced in the graph, holds no bytes
        transpose = by_output[hwoi_name]
        assert transpose.op_type == "Transpose"
        (weight_name, weight_type, weight_dims) = _io(transpose, "inputs")[0]
        assert weight_type == "QNN_TENSOR_TYPE_STATIC"
        assert weight_name in forward_weights  # the forward Conv2d's very tensor
        assert hwoi_dims == [weight_dims[i] for i in geo.HWIO_TO_HWOI]
        transposes[transpose.name] = weight_name
    # Two backward nodes on the shared weight, one Transpose for it.
    assert len(transposes) == 2
    static_names = [
        name
        for op in ops
        for name, kind, _ in _io(op, "inputs")
        if kind == "QNN_TENSOR_TYPE_STATIC"
    ]
    for weight in transposes.values():
        assert weight in static_names


def test_emitted_parameters(shared_weight_lowering):
    _, _, joint, compiled, graphs, params = shared_weight_lowering
    ops = graphs[0]
    by_output = {out[0]: op for op in ops for out in _io(op, "outputs")}
    tconvs = [op for op in ops if op.op_type == "TransposeConv2d"]
    tconv_names = [op.name for op in tconvs]
    assert all(params[(n, "stride")] == [1, 1] for n in tconv_names)
    # The stride-2 conv's grad_output is upsampled first (Options.stride="zero_insert"):
    # per spatial dim a zero Pad of the next axis and a Reshape; no TransposeConv2d stride.
    down = [op for op in tconvs if by_output[_io(op, "inputs")[0][0]].op_type == "Reshape"]
    assert len(down) == 1 and len(tconvs) == 3
    chain, name = [], _io(down[0], "inputs")[0][0]
    while name in by_output and by_output[name].op_type in ("Pad", "Reshape"):
        chain.append(by_output[name])
        name = _io(chain[-1], "inputs")[0][0]
    assert [op.op_type for op in chain] == ["Reshape", "Pad"] * 2
    # NHWC [N, 5, 5, 16]: W padded to 10 (then H -> 10), C padded to 32 (then W -> 10).
    pads = [params[(op.name, "pad_amount")] for op in chain[1::2]]
    assert pads == [[[0, 0], [0, 0], [0, 0], [0, 16]], [[0, 0], [0, 0], [0, 5], [0, 0]]]
    # 10x10 -> 5x5 with k3 s2 p1, upsampled to 10x10: extent 12, crop 1 at each end.
    upsampled_dims = _io(chain[0], "outputs")[0][2]
    assert list(upsampled_dims[1:3]) == [10, 10]
    for name in tconv_names:
        assert params[(name, "pad_amount")] == [[1, 1], [1, 1]]
        assert params[(name, "output_padding")] == [0, 0]
    assert all(params[(n, "group")] == 1 for n in tconv_names)
    transposes = [
        op.name
        for op in graphs[0]
        if op.op_type == "Transpose" and op.outputs[0].name.endswith("_convbwd_hwoi")
    ]
    perms = [params[(n, "perm")] for n in transposes if (n, "perm") in params]
    assert perms and all(p == list(geo.HWIO_TO_HWOI) for p in perms)


def test_shared_weight_training_graph_matches_autograd(shared_weight_lowering):
    model, inputs, joint, compiled, _, _ = shared_weight_lowering
    rows = {r.node: r for r in compiled.report.rows}
    input_grad_rows = [r for r in rows.values() if r.output_mask == [True, False, False]]
    assert len(input_grad_rows) == 3 and all(r.delegated for r in input_grad_rows)
    expected = models.autograd_reference(model, inputs, joint)
    for a, b in zip(_user_outputs(compiled.run(inputs), expected), expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=5e-3 * b.abs().max().item() + 1e-6)


# --- end to end on real training graphs ---------------------------------------------


def _user_outputs(outputs: list, expected: list) -> list:
    """The loss and gradients; executorch appends the trainable parameters of a joint
    program as extra (TOKEN) outputs after them."""
    assert len(outputs) >= len(expected)
    return outputs[: len(expected)]


@pytest.mark.parametrize(
    "backbone,size", [("basic_block", 8), ("stride2_block", 9), ("stride2_block", 10)]
)
def test_frozen_backbone_training_graph(qnn_sdk, backbone, size):
    """Every convolution_backward (the frozen convs' input gradients and the adapter's
    weight/bias gradients) is delegated; one delegate; autograd's numbers.

    Whole-graph tolerance: a few fp16 layers (u = 4.9e-4) on values of order 1;
    5e-3 of each output's scale leaves room for ~10 roundings in the chain.
    """
    from qnn_convbwd.toolchain import harness

    graph = models.training_graph(backbone, size=size)
    compiled = harness.lower_program(graph.program, "SM8650")
    input_grads = [r for r in compiled.report.rows if r.output_mask == [True, False, False]]
    assert input_grads and all(r.delegated for r in compiled.report.rows)
    assert harness.delegate_count(compiled.edge) == 1
    reference = graph.reference()
    for got, expected in zip(
        _user_outputs(compiled.run(graph.inputs), reference), reference, strict=True
    ):
        tol = 5e-3 * expected.abs().max().item() + 1e-6
        torch.testing.assert_close(got, expected, rtol=0, atol=tol)


# --- numerics over generated configurations -----------------------------------------


def _check_bank(compiled, bank: ConvBackwardBank) -> float:
    inputs = bank.example_inputs()
    got = compiled.run(inputs)
    expected = bank(*inputs)
    worst = 0.0
    for config, weight, g, a, b in zip(
        bank.configs, bank.weights, inputs, got, expected, strict=True
    ):
        scale = U_FP16 * fp16_error_bound(config, weight, g) + 1e-6
        ratio = ((a - b).abs() / scale).max().item()
        assert ratio <= BOUND_FACTOR, f"{config}: error {ratio:.2f} u*|g||w| > {BOUND_FACTOR}"
        worst = max(worst, ratio)
    return worst


@pytest.mark.parametrize("soc", sweep(["SM8450"], ["SM8850"]))  # V69; V81 with --slow
def test_generated_configs_match_aten_on_the_simulator(qnn_sdk, soc):
    from qnn_convbwd.toolchain import harness

    configs = generate_configs(42)
    kinds = {
        "stride": {c.stride for c in configs},
        "padding": set(itertools.chain.from_iterable(c.padding for c in configs)),
        "groups": {"1" if c.groups == 1 else "dw" if c.groups == c.cin else "g" for c in configs},
        "kernel": {c.kernel for c in configs},
        "batch": {c.batch for c in configs},
        "odd": {any(s % 2 for s in c.size) for c in configs},
    }
    assert {1, 2, 3} <= set(itertools.chain.from_iterable(kinds["stride"]))
    assert kinds["padding"] == {0, 1, 2}
    assert kinds["groups"] == {"1", "g", "dw"}
    assert {(3, 1), (1, 1), (5, 5)} <= kinds["kernel"]
    assert kinds["batch"] == {1, 2} and kinds["odd"] == {True, False}

    bank = ConvBackwardBank(configs)
    compiled = harness.lower_program(bank.export(), soc)
    assert compiled.report.delegated == len(configs)
    assert harness.delegate_count(compiled.edge) == 1
    _check_bank(compiled, bank)


# --- HTP defects the lowering works around --------------------------------------------

DEPTHWISE_OP_WITHIN_PAD = Config(1, 8, 8, (3, 3), (2, 2), (1, 1), 8, (10, 10))
BEYOND_FULL_EXTENT = Config(1, 8, 16, (3, 3), (3, 3), (1, 0), 1, (10, 14))


@pytest.mark.parametrize("stride", geo.STRIDE_MODES)
def test_workaround_computes_the_defective_cases_right(qnn_sdk, stride):
    """Both ways around the defective parameter: upsampling (default) and, with
    TransposeConv2d's stride, the "auto" output padding plan. Both defective
    configurations in one program, each checked on its own outputs."""
    from qnn_convbwd.toolchain import harness

    configs = [DEPTHWISE_OP_WITHIN_PAD, BEYOND_FULL_EXTENT]
    bank = ConvBackwardBank(configs)
    assert not any(geo.parameter_is_reliable(conv_backward_of(c)) for c in configs)
    with qnn_convbwd.enabled(stride=stride):
        compiled = harness.lower_program(bank.export(), "SM8650")
    assert compiled.report.delegated == len(configs)
    _check_bank(compiled, bank)


@pytest.mark.xfail(
    strict=True,
    reason="HTP defect (QAIRT 2.51 simulator): TransposeConv2d output_padding is wrong for "
    "depthwise convs and beyond the full extent. XPASS means QAIRT fixed it: revisit "
    "geometry.conv.parameter_is_reliable.",
)
@pytest.mark.parametrize("config", [DEPTHWISE_OP_WITHIN_PAD, BEYOND_FULL_EXTENT], ids=str)
def test_output_padding_parameter_is_still_defective(qnn_sdk, config):
    from qnn_convbwd.toolchain import harness

    bank = ConvBackwardBank([config])
    with qnn_convbwd.enabled(output_padding="parameter", stride="parameter"):
        compiled = harness.lower_program(bank.export(), "SM8650")
    _check_bank(compiled, bank)


def test_skip_options_keep_every_node_on_cpu_and_the_program_runs(qnn_sdk):
    """executorch's skip option wins over the rules; no shape-only stand-in or getitem
    of a skipped node is delegated on its own (that crashed the runtime before)."""
    from qnn_convbwd.toolchain import harness

    graph = models.training_graph("demo", size=15, trainable_backbone=True)
    compiled = harness.lower_program(
        graph.program, "SM8650", skip_node_op_set={"aten.convolution_backward.default"}
    )
    assert compiled.report.rows and not any(r.delegated for r in compiled.report.rows)
    assert all("skip" in r.reason or "not partitioned" in r.reason for r in compiled.report.rows)
    reference = graph.reference()
    for got, expected in zip(
        _user_outputs(compiled.run(graph.inputs), reference), reference, strict=True
    ):
        torch.testing.assert_close(
            got, expected, rtol=0, atol=5e-3 * expected.abs().max().item() + 1e-6
        )


def test_skip_node_id_set_keeps_the_named_node_though_a_split_renumbers_nodes(qnn_sdk):
    """skip_node_id_set names nodes as executorch's to_edge names them. The transform
    pass splits the first node in two; the passes after it renumber the nodes of one op
    in graph order, so the name then belongs to that node's second half. The node the
    user named must stay on CPU, and only it."""
    from executorch.exir import to_edge

    from qnn_convbwd.toolchain import harness

    graph = models.training_graph("linear", size=9, trainable_backbone=True)
    edge_names = [
        n.name
        for n in to_edge(graph.program).exported_program().graph.nodes
        if "convolution_backward" in str(n.target)
    ]
    compiled = harness.lower_program(graph.program, "SM8650", skip_node_id_set={edge_names[1]})
    rows = {r.node: r for r in compiled.report.rows}
    assert not rows["convolution_backward_1"].delegated
    assert rows["convolution_backward_1"].reason == "kept on CPU by executorch's skip options"
    assert rows["convolution_backward"].delegated and rows["convolution_backward_2"].delegated
    (kept,) = [
        n
        for n in compiled.edge.exported_program().graph.nodes
        if "convolution_backward" in str(n.target)
    ]
    assert list(kept.args[10]) == [True, True, True] and list(kept.args[4]) == [1, 1]
    reference = graph.reference()
    for got, expected in zip(
        _user_outputs(compiled.run(graph.inputs), reference), reference, strict=True
    ):
        torch.testing.assert_close(
            got, expected, rtol=0, atol=5e-3 * expected.abs().max().item() + 1e-6
        )
