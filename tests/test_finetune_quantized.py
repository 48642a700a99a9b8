"""``qnn-convbwd finetune --quantize``: the backbone quantized on the training data, the
float head trained (``--scheme head``) or float adapters inside the backbone and the
head (``--scheme adapter``); its outputs, checkpoints, resume and refusals.

The runs train the small ConvBn net of ``test_finetune_tool`` on its tiny ImageFolders
of digits at 8x8, as the CPU-only program (SM8350), so they lower in seconds. There
executorch's FoldQDQ removes the activations' quantize / dequantize pairs: the program
computes the backbone in float with its int8 weights dequantized, and the torch copy
runs the converted backbone with them, so the two differ by the activations'
quantization (docs/quantized.md).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from test_finetune_tool import BATCH, MODEL, SIZE, _main, _refused, _val, make_folder

from qnn_convbwd import finetune, quantized

STEPS = 12
CALIBRATION = 3


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("digits")
    return make_folder(root / "train", 20), make_folder(root / "val", 5, offset=20)


def run_args(train: Path, val: Path, out: Path) -> list[str]:
    return [
        "finetune", "--model", MODEL, "--data", str(train), "--val", str(val),
        "--size", str(SIZE), "--batch", str(BATCH), "--steps", str(STEPS), "--cpu",
        "--lr", "0.05", "--quantize", "8a8w", "--calibration-batches", str(CALIBRATION),
        "--checkpoint-every", "4", "--out", str(out),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def finished(folders, tmp_path_factory, qnn_sdk):
    out = tmp_path_factory.mktemp("run") / "run"
    code, printed = _main(run_args(*folders, out))
    assert code == 0, printed
    return out, printed


def _quantized_model(folders, report: dict) -> quantized.QuantizedBackbone:
    """The run's model rebuilt from its inputs: the small net from the run's seed, its
    backbone quantized on the same calibration batches of the same training data."""
    from qnn_convbwd import finetune_data

    seed = report["args"]["seed"]
    net = finetune.apply_scheme(finetune.user_model(MODEL, 4, seed), "head")
    data = finetune_data.load(folders[0], SIZE, classes=report["classes"])
    normalize = finetune_data.Normalize(report["normalize"]["mean"], report["normalize"]["std"])
    train = (normalize(data.x), data.y)
    model, _ = finetune.quantize_for_fit(net, train, BATCH, "8a8w", CALIBRATION, seed)
    return model


def test_a_scheme_training_quantized_weights_is_refused(folders, tmp_path, capsys):
    """A scheme whose gradients would update quantized weights is refused before anything
    is written, with the reason; so is a library call."""
    for scheme in ("full", "bias-only", "last-layers"):
        out = tmp_path / scheme
        err = _refused([*run_args(*folders, out), "--scheme", scheme], capsys, out)
        assert f"--scheme {scheme} with --quantize: it trains quantized weights" in err
        assert "--scheme head or adapter" in err
    with pytest.raises(ValueError, match="'bias-only' trains quantized weights"):
        finetune.fit(torch.nn.Linear(2, 2), (torch.zeros(4, 2), torch.zeros(4)), None,
                     scheme="bias-only", quantize="8a8w")  # fmt: skip


def test_the_head_scheme_trains_the_classifier_child_alone():
    from test_finetune_tool import small_model

    net = finetune.apply_scheme(small_model(4), "head")
    assert finetune.trainable_names(net) == ["9.weight", "9.bias"]
    cifar = finetune.apply_scheme(finetune.architecture("cifar"), "head")
    assert all(n.startswith("classifier.") for n in finetune.trainable_names(cifar))
    assert len(finetune.trainable_names(cifar)) == 4  # both linear layers of the classifier


def test_quantized_run_writes_its_outputs(finished, folders):
    out, printed = finished
    assert "backbone quantized 8a8w on 3 training batches" in printed
    names = {p.name for p in out.iterdir()}
    assert {"model.pt", "train.pte", "infer.pte", "report.json", "checkpoint.pt"} <= names
    report = json.loads((out / "report.json").read_text())
    q = report["quantization"]
    assert q["scheme"] == "8a8w" and q["calibration_batches"] == CALIBRATION
    assert report["args"]["scheme"] == "head"
    # The backbone trained nothing: the program's state is the converted backbone's as
    # quantized, the head's parameters moved.
    model = _quantized_model(folders, report)
    assert quantized.digest(model) == q["backbone_digest"]
    trained = torch.load(out / "model.pt")
    for name, value in model.state_dict().items():
        if name.startswith("backbone."):
            assert torch.equal(trained[name], value), name
    assert not torch.equal(trained["9.weight"], model.state_dict()["9.weight"])
    # int8 convolution weights in the backbone: the batch norms folded into them.
    weights = quantized.int8_weights(model)
    assert len(weights) == 2 and all(w.dtype == torch.int8 for w in weights.values())


def test_quantized_model_pt_gives_the_reported_accuracy(finished, folders):
    """model.pt loaded into the quantized model rebuilt from the run's inputs classifies
    the held-out images as the report says; the program's losses follow torch's within
    the activations' quantization (the CPU program does not quantize them)."""
    out, _ = finished
    report = json.loads((out / "report.json").read_text())
    model = _quantized_model(folders, report)
    model.load_state_dict(torch.load(out / "model.pt"))
    x, y = _val(folders, report)
    with torch.no_grad():
        right = int((model.eval()(x).argmax(1) == y).sum())
    assert right / len(y) == report["val_accuracy"]
    gaps = [abs(a - b) for a, b in zip(report["losses"], report["torch_losses"])]
    assert max(gaps) <= 3e-2 * max(1.0, *map(abs, report["torch_losses"])), gaps


def test_quantized_infer_pte_predicts_as_the_eager_model(finished, folders):
    from qnn_convbwd.toolchain import harness

    out, _ = finished
    report = json.loads((out / "report.json").read_text())
    model = _quantized_model(folders, report)
    model.load_state_dict(torch.load(out / "model.pt"))
    x, _ = _val(folders, report)
    pte = (out / "infer.pte").read_bytes()
    with torch.no_grad():
        eager = model.eval()(x)
    logits = torch.cat([harness.run_pte(pte, [image[None]])[0] for image in x])
    assert (logits.argmax(1) == eager.argmax(1)).float().mean() >= 0.9
    assert torch.allclose(logits, eager, atol=0.1 * float(eager.abs().max())), (
        (logits - eager).abs().max()
    )


def test_quantized_run_resumes_to_the_same_run(finished, tmp_path):
    """``--resume`` from the last checkpoint quantizes the backbone again (the same
    digest) and ends with the same losses and weights, to the bit."""
    out = tmp_path / "run"
    shutil.copytree(finished[0], out)
    for name in ("report.json", "model.pt", "train.pte", "infer.pte"):
        (out / name).unlink()
    code, printed = _main(["finetune", "--resume", str(out)])
    assert code == 0, printed
    assert f"resuming {out} after step {STEPS - 4} of {STEPS}" in printed
    a = json.loads((out / "report.json").read_text())
    b = json.loads((finished[0] / "report.json").read_text())
    assert a["losses"] == b["losses"] and a["torch_losses"] == b["torch_losses"]
    assert a["quantization"] == b["quantization"]
    ours, theirs = torch.load(out / "model.pt"), torch.load(finished[0] / "model.pt")
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_a_resume_whose_backbone_differs_is_refused(finished, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(finished[0], out)
    checkpoint = torch.load(out / finetune.CHECKPOINT_FILE, weights_only=True)
    checkpoint["quantization"]["backbone_digest"] = "0" * 64
    torch.save(checkpoint, out / finetune.CHECKPOINT_FILE)
    code = _main(["finetune", "--resume", str(out)])[0]
    captured = capsys.readouterr()
    assert code == 2, captured
    assert "quantized backbone differs" in captured.err


BLOCKED = "test_finetune_quantized:blocked_model"


def blocked_model(num_classes: int = 10) -> torch.nn.Module:
    """Three convolution / batch norm / ReLU blocks, average pool and a linear head: the
    adapters go after whole blocks, so every batch norm folds into its convolution."""
    from torch import nn

    def block(cin: int, cout: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())

    return nn.Sequential(
        block(3, 8), block(8, 8), block(8, 16), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(16, num_classes),
    )  # fmt: skip


@pytest.fixture(scope="module")
def adapted(folders, tmp_path_factory, qnn_sdk):
    out = tmp_path_factory.mktemp("adapted") / "run"
    args = [*run_args(*folders, out), "--scheme", "adapter"]
    args[args.index(MODEL)] = BLOCKED
    code, printed = _main(args)
    assert code == 0, printed
    return out, printed


def test_adapters_train_inside_the_quantized_backbone(adapted, folders):
    """``--scheme adapter``: the residual adapters stay float inside the quantized backbone
    and train with the head; every quantized tensor is as quantized, the digest (which
    leaves out what trains) is the rebuilt backbone's, and the losses follow torch's
    with the straight-through estimator within the bound."""
    from qnn_convbwd import finetune_data

    out, printed = adapted
    report = json.loads((out / "report.json").read_text())
    assert report["args"]["scheme"] == "adapter"
    seed = report["args"]["seed"]
    net = finetune.apply_scheme(finetune.user_model(BLOCKED, 4, seed), "adapter")
    data = finetune_data.load(folders[0], SIZE, classes=report["classes"])
    normalize = finetune_data.Normalize(report["normalize"]["mean"], report["normalize"]["std"])
    model, _ = finetune.quantize_for_fit(
        net, (normalize(data.x), data.y), BATCH, "8a8w", CALIBRATION, seed
    )
    assert quantized.digest(model) == report["quantization"]["backbone_digest"]
    adapters = [n for n in finetune.trainable_names(model) if ".adapter." in n]
    assert len(adapters) == 2 * finetune.ADAPTED_BLOCKS, finetune.trainable_names(model)
    trained = torch.load(out / "model.pt")
    before = model.state_dict()
    for name in adapters:
        assert not torch.equal(trained[name], before[name]), f"{name} did not train"
    for name, value in quantized.int8_weights(model).items():
        assert torch.equal(trained[name], value), name
    gaps = [abs(a - b) for a, b in zip(report["losses"], report["torch_losses"])]
    assert max(gaps) <= 3e-2 * max(1.0, *map(abs, report["torch_losses"])), gaps
    model.load_state_dict(trained)
    x, y = _val(folders, report)
    with torch.no_grad():
        right = int((model.eval()(x).argmax(1) == y).sum())
    assert right / len(y) == report["val_accuracy"]
