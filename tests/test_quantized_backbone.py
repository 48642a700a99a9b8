"""A pt2e-quantized frozen backbone (8a8w, per-channel weights) under a float head that
trains, lowered for training (docs/quantized.md).

ExecuTorch's CIFAR model: ``features`` calibrated and converted with executorch's
``QnnQuantizer``, ``classifier`` left float and trainable
(``qnn_convbwd_dev.quantized_backbone``). On SM8650 the quantized
convolutions, the float head with its backward and the loss are one delegate: the
head reads the backbone's uint8 output through a dequantizing copy
(``passes.quant_boundary``, QNN's Dequantize). The reference is torch running the
same converted backbone in fp32 (its quantize / dequantize pairs computed eagerly)
under the head, trained by ``torch.optim.SGD``.
"""

from __future__ import annotations

import collections
import copy
import functools
import math

import pytest
import quantized_lowering
import torch
from torch import nn

from qnn_convbwd_dev import quantized_backbone as qb

STEPS = 3
LR = 0.05


@functools.cache
def _lowered(soc: str):
    """(model as lowered, the program, the QNN graphs built) for ``soc``."""
    return quantized_lowering.lowered_with_graphs(qb.quantized_cifar("8a8w", "split"), soc)


def _assert_losses_follow_torch(model, program) -> None:
    """Each step's loss within 3e-2 * max(1, |loss|) of torch's."""
    quantized_lowering.assert_losses_follow_torch(model, program, STEPS, LR, qb.train_both)


@pytest.mark.htp
def test_quantized_backbone_and_float_head_are_one_delegate(qnn_sdk):
    from qnn_convbwd.toolchain import harness

    model, program, graphs = _lowered("SM8650")
    assert program.report.on_cpu == [], program.report.on_cpu_markdown()
    assert harness.delegate_count(program.edge) == 1
    (ops,) = graphs
    kinds = collections.Counter(op.op_type for op in ops)
    # The backbone's three convolutions, the head's matmuls (forward and backward), the
    # input's quantize and the one dequantize where the head reads the backbone.
    assert kinds["Conv2d"] == 3 and kinds["MatMul"] >= 4, kinds
    assert kinds["Quantize"] == 1 and kinds["Dequantize"] == 1, kinds


@pytest.mark.htp
def test_backbone_weights_are_stored_once_as_int8(qnn_sdk):
    from torch.export.graph_signature import InputKind

    from qnn_convbwd.toolchain import harness

    model, program, graphs = _lowered("SM8650")
    (ops,) = graphs
    weights = qb.int8_weights(model)
    assert len(weights) == 3
    convs = [op for op in ops if op.op_type == "Conv2d"]
    static_reads = collections.Counter(t.name for op in ops for t in op.inputs if t.is_static)
    stored = sorted(
        (math.prod(op.inputs[1].dims), op.inputs[1].nbytes)
        for op in convs
        if op.inputs[1].is_static and static_reads[op.inputs[1].name] == 1
    )
    # One byte an element, each read by its convolution alone.
    assert stored == sorted((w.numel(), w.numel()) for w in weights.values()), stored

    # No copy outside the delegate: the program's own inputs are the head's parameters.
    ep = program.edge.exported_program()
    kept = {
        s.target
        for s in ep.graph_signature.input_specs
        if s.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
    }
    head = {f"net.classifier.{name}" for name, _ in model.classifier.named_parameters()}
    assert kept == head, kept
    trainable_bytes = sum(p.numel() * 4 for p in model.classifier.parameters())
    float_backbone_bytes = sum(w.numel() * 4 for w in weights.values())
    context_bytes = sum(len(b) for b in harness.context_binaries(program.edge))
    overhead = len(program.pte) - trainable_bytes - context_bytes
    assert overhead < float_backbone_bytes, (
        f".pte holds {overhead} bytes beside the head and the context: a float copy of "
        f"the backbone ({float_backbone_bytes} bytes) would fit"
    )


@pytest.mark.htp
def test_three_sgd_steps_follow_torch_on_the_simulator(qnn_sdk):
    model, program, _ = _lowered("SM8650")
    _assert_losses_follow_torch(model, program)


@pytest.mark.htp
@pytest.mark.slow(reason="a third lowering; the SM8650 tests above are the default tier's")
def test_below_v69_the_program_runs_on_cpu_and_follows_torch(qnn_sdk):
    """SM8350 (V68): the training graph stays on CPU as a whole (rule
    ``training_graph_below_v69``, which a joint graph without the plugin's backward ops
    meets too); the dequantizing copy is a float copy there."""
    from qnn_convbwd.toolchain import harness

    model, program, graphs = _lowered("SM8350")
    assert harness.delegate_count(program.edge) == 0 and graphs == []
    rules = {op.rule for op in program.report.on_cpu}
    assert rules == {"training_graph_below_v69"}, program.report.on_cpu_markdown()
    # executorch's FoldQDQ removed the activations' quantize / dequantize pairs: the
    # CPU program computes them in float, as torch does without those pairs.
    x, y = qb.batches(2)[1]
    session = program.session(LR)
    try:
        ours = session.step([x, y])
    finally:
        session.close()
    with torch.no_grad():
        unquantized = nn.functional.cross_entropy(qb.without_activation_quantization(model)(x), y)
    assert abs(ours - unquantized.item()) <= 1e-5, (ours, unquantized.item())
    _assert_losses_follow_torch(model, program)


@pytest.mark.htp
@pytest.mark.slow(reason="two more lowerings and six simulator steps")
@pytest.mark.parametrize(("dtype", "mode"), [("8a8w", "whole"), ("16a8w", "split")])
def test_other_quantizations_are_one_delegate_and_follow_torch(qnn_sdk, dtype, mode):
    """The whole model quantized with the head's nodes left unannotated; 16-bit
    activations (QuantDtype.use_16a8w)."""
    from qnn_convbwd import training
    from qnn_convbwd.toolchain import harness

    model = qb.quantized_cifar(dtype, mode)
    program = training.lower_for_training(
        training.WithLoss(copy.deepcopy(model), nn.functional.cross_entropy),
        qb.batches(1)[0],
        harness.compile_specs("SM8650"),
    )
    assert program.report.on_cpu == [], program.report.on_cpu_markdown()
    assert harness.delegate_count(program.edge) == 1
    _assert_losses_follow_torch(model, program)


@pytest.mark.htp
@pytest.mark.slow(reason="a torchvision backbone's lowering (25 to 60 s) and 3 simulator steps")
@pytest.mark.parametrize("arch", ["resnet18", "mobilenet_v2"])
def test_torchvision_backbones_are_one_delegate_and_follow_torch(qnn_sdk, arch):
    """resnet18 (residual adds, batch norms folded, adaptive average pool) and
    mobilenet_v2 (ReLU6 as hardtanh, depthwise convolutions): the whole backbone
    quantized 8a8w, each convolution's weight one int8 static tensor, under the float
    ``fc`` / ``classifier``, one delegate; three SGD steps at the model's rate
    (``qb.LR``) within the bound of torch running the converted model."""
    from qnn_convbwd import integration, training
    from qnn_convbwd.toolchain import harness

    model = qb.quantized_model(arch, "8a8w")
    with integration.capture_qnn_graphs() as graphs:
        program = training.lower_for_training(
            training.WithLoss(copy.deepcopy(model), nn.functional.cross_entropy),
            qb.batches(1)[0],
            harness.compile_specs("SM8650"),
        )
    assert program.report.on_cpu == [], program.report.on_cpu_markdown()
    assert harness.delegate_count(program.edge) == 1
    (ops,) = graphs
    weights = qb.int8_weights(model)
    convs = [op for op in ops if op.op_type in ("Conv2d", "DepthWiseConv2d")]
    assert len(convs) == len(weights)
    # Every convolution reads a static weight of one byte an element.
    stored = sorted(op.inputs[1].nbytes for op in convs if op.inputs[1].is_static)
    assert stored == sorted(w.numel() for w in weights.values())
    steps = qb.train_both(model, program, qb.batches(STEPS + 1)[1:], qb.LR[arch])
    for step, (ours, theirs, _) in enumerate(steps):
        bound = 3e-2 * max(1.0, abs(theirs))
        assert abs(ours - theirs) <= bound, f"step {step}: {ours} vs torch {theirs} (> {bound})"


def test_fused_activations_drops_the_rounding_between_a_convolution_and_its_relu():
    """The reference that rounds a convolution + ReLU once: the quantize / dequantize
    pair between them gone, the ReLU's own kept; its output differs from the converted
    model's by at most one step of the convolution's quantization."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    from qnn_convbwd import quantized

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU()).eval()
    x = torch.randn(4, 3, 8, 8)
    prepared = prepare_pt2e(torch.export.export(net, (x,)).module(), quantized.quantizer("8a8w"))
    prepared(x)
    converted = convert_pt2e(prepared)
    fused = qb.fused_activations(converted)
    quantize = torch.ops.quantized_decomposed.quantize_per_tensor.default

    def quantizes(module):
        return [n for n in module.graph.nodes if n.target == quantize]

    assert len(quantizes(fused)) == len(quantizes(converted)) - 1
    relus = (torch.ops.aten.relu.default, torch.ops.aten.relu_.default)
    (relu,) = [n for n in fused.graph.nodes if n.target in relus]
    assert relu.args[0].target == torch.ops.aten.conv2d.default
    conv_scale = next(
        n.args[1] for n in quantizes(converted) if n.args[0].target == torch.ops.aten.conv2d.default
    )
    with torch.no_grad():
        ours, theirs = fused(x), converted(x)
    assert not torch.equal(ours, theirs)
    assert float((ours - theirs).abs().max()) <= conv_scale * 1.01


def test_trained_model_is_cached_and_read_back(tmp_path):
    """``trained_model`` writes the state dict it trained to the cache, and a later call
    reads that file instead of training (here the file altered in between comes back);
    a file that is not such a checkpoint is refused with its path."""
    from qnn_convbwd import finetune

    first = qb.trained_model("cifar", epochs=0, cache=tmp_path)
    (path,) = tmp_path.iterdir()
    assert path.name == "cifar-seed0-epochs0-lr0.01.pt"
    untouched = finetune.architecture("cifar", seed=0).state_dict()
    assert all(torch.equal(v, untouched[k]) for k, v in first.state_dict().items())
    altered = {k: v + 1 if v.is_floating_point() else v for k, v in untouched.items()}
    torch.save(altered, path)
    again = qb.trained_model("cifar", epochs=0, cache=tmp_path)
    assert not again.training
    assert all(torch.equal(v, altered[k]) for k, v in again.state_dict().items())
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=str(path)):
        qb.trained_model("cifar", epochs=0, cache=tmp_path)


def test_trained_batches_are_digits_the_model_did_not_train_on():
    """With ``trained``: the stepping batches are drawn from the digits' test split, the
    calibration batches from its training split, both seeded."""
    from qnn_convbwd import finetune

    split = finetune.digits(qb.SIZE)

    def rows(x: torch.Tensor) -> set[bytes]:
        return {image.numpy().tobytes() for image in x}

    train, test = rows(split.train[0]), rows(split.test[0])
    found = qb.batches(4, trained=True)
    assert [tuple(x.shape) for x, _ in found] == [(qb.BATCH, 3, qb.SIZE, qb.SIZE)] * 4
    images = torch.cat([x for x, _ in found])
    assert rows(images) <= test and not rows(images) & train
    labels = {image.numpy().tobytes(): int(y) for image, y in zip(*split.test, strict=True)}
    assert all(
        labels[image.numpy().tobytes()] == int(y) for x, ys in found for image, y in zip(x, ys)
    )
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(found, qb.batches(4, trained=True)))
    assert not torch.equal(found[0][0], qb.batches(1, seed=2, trained=True)[0][0])
    calibration = qb.calibration_batches(trained=True)
    assert len(calibration) == qb.CALIBRATION_BATCHES
    assert rows(torch.cat(calibration)) <= train
    with pytest.raises(ValueError, match="test split has 297"):
        qb.batches(100, trained=True)


def test_the_quantizer_makes_the_sdk_usable_before_executorch_looks_for_one(qnn_sdk):
    """Building ``quantized.quantizer`` in a process with no ``QNN_SDK_ROOT`` (a user's
    script that quantizes before lowering anything) exports the plugin's SDK root first:
    executorch's ``QnnQuantizer`` then finds it, rather than downloading an SDK and
    libc++ (with a traceback per attempt when offline), and the quantizer has the
    settings asked for."""
    import os
    import subprocess
    import sys

    from qnn_convbwd.toolchain import active_sdk

    root = active_sdk().root
    env = {k: v for k, v in os.environ.items() if k != "QNN_SDK_ROOT"}
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p and str(root) not in p
    )
    child = (
        "import os\n"
        "from qnn_convbwd import quantized\n"
        "q = quantized.quantizer('16a8w', qat=True)\n"
        "config = q.default_quant_config\n"
        "print('ROOT', os.environ.get('QNN_SDK_ROOT'))\n"
        "print('QAT', config.is_qat, 'PER_CHANNEL', config.is_conv_per_channel)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=300
    )
    printed = done.stdout + done.stderr
    assert done.returncode == 0, printed[-3000:]
    assert "Downloading" not in printed and "Failed to stage" not in printed, printed[-3000:]
    assert f"ROOT {root}" in done.stdout
    assert "QAT True PER_CHANNEL True" in done.stdout
