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


def adapter_args(folders, out: Path, *more: str) -> list[str]:
    args = [*run_args(*folders, out), "--scheme", "adapter", *more]
    args[args.index(MODEL)] = BLOCKED
    return args


def recorded_run(args: list[str]) -> tuple[str, list[bytes]]:
    """``_main(args)``, and the bytes of every checkpoint it wrote, in order (each
    replaces the one before in the run's folder)."""
    written = []
    save = finetune.save_atomic

    def recording(path, value) -> None:
        save(path, value)
        if Path(path).name == finetune.CHECKPOINT_FILE:
            written.append(Path(path).read_bytes())

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(finetune, "save_atomic", recording)
        code, printed = _main(args)
    assert code == 0, printed
    return printed, written


# The adapter run: one epoch of the head alone (20 steps of 4 of the 80 training
# images, the default with --quantize), then STEPS steps of the adapters and the head.
HEAD_STEPS = 20


@pytest.fixture(scope="module")
def adapted(folders, tmp_path_factory, qnn_sdk):
    """The adapter scheme's run with its default warm start: (out folder, printed output,
    the bytes of every checkpoint it wrote)."""
    out = tmp_path_factory.mktemp("adapted") / "run"
    printed, written = recorded_run(adapter_args(folders, out))
    return out, printed, written


def test_adapters_train_inside_the_quantized_backbone(adapted, folders):
    """``--scheme adapter``: the residual adapters stay float inside the quantized backbone
    and train with the head; every quantized tensor is as quantized, the digest (which
    leaves out what trains) is the rebuilt backbone's, and the losses follow torch's
    with the straight-through estimator within the bound."""
    out, printed, _ = adapted
    report = json.loads((out / "report.json").read_text())
    assert report["args"]["scheme"] == "adapter"
    model = _adapted_model(folders, report)
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


def _checkpoint(data: bytes) -> dict:
    import io

    return torch.load(io.BytesIO(data), weights_only=True)


def _adapted_model(folders, report: dict) -> quantized.QuantizedBackbone:
    """The adapter run's quantized model rebuilt from its inputs, before training."""
    from qnn_convbwd import finetune_data

    seed = report["args"]["seed"]
    net = finetune.apply_scheme(finetune.user_model(BLOCKED, 4, seed), "adapter")
    data = finetune_data.load(folders[0], SIZE, classes=report["classes"])
    normalize = finetune_data.Normalize(report["normalize"]["mean"], report["normalize"]["std"])
    model, _ = finetune.quantize_for_fit(
        net, (normalize(data.x), data.y), BATCH, "8a8w", CALIBRATION, seed
    )
    return model


def test_the_warm_start_trains_the_head_alone_then_the_adapters(adapted, folders):
    """``--scheme adapter --quantize``: an epoch of the head alone at 0.02 (its program
    trains the head's tensors and nothing else: the adapters stay zero), then the
    adapters and the head at ``--lr`` with a fresh optimizer; the checkpoints follow
    the phases, one written as the second starts."""
    out, printed, written = adapted
    report = json.loads((out / "report.json").read_text())
    assert "first 1 epoch(s) of the head alone at lr 0.02, then adapter" in printed
    assert f"phase 1, the head alone: steps 1-{HEAD_STEPS}, sgd lr 0.02, momentum 0.9" in printed
    assert f"phase 2, scheme adapter: steps {HEAD_STEPS + 1}-{HEAD_STEPS + STEPS}, sgd lr 0.05" in (
        printed
    )
    phases = report["phases"]
    assert [(p["trains"], p["first"], p["steps"]) for p in phases] == [
        ("head", 0, HEAD_STEPS),
        ("adapter", HEAD_STEPS, STEPS),
    ]
    assert [p["optimizer"]["lr"] for p in phases] == [finetune.HEAD_LR, 0.05]
    assert report["steps"] == len(report["losses"]) == HEAD_STEPS + STEPS
    # Evaluated after each phase.
    assert phases[0]["program_accuracy"] == next(
        e["program_accuracy"] for e in report["evaluations"] if e["step"] == HEAD_STEPS
    )
    states = [_checkpoint(data) for data in written]
    assert [(s["phase"], s["step"]) for s in states] == [
        (0, 4), (0, 8), (0, 12), (0, 16), (1, HEAD_STEPS), (1, 24), (1, 28),
    ]  # fmt: skip
    model = _adapted_model(folders, report)
    before = model.state_dict()
    adapters = [n for n in finetune.trainable_names(model) if ".adapter." in n]
    head = [n for n in finetune.trainable_names(model) if n not in adapters]
    assert adapters and head == ["5.weight", "5.bias"]
    program = f"net.{head[0]}"
    for state in states:
        kept = {n for n in state["program_state"] if n.startswith("net.")}
        trains = head if state["phase"] == 0 else head + adapters
        assert kept == {f"net.{n}" for n in trains}, (state["step"], kept)
    # As the adapters' phase starts: the head trained, program and torch; the adapters
    # as initialised (zero; the program keeps a weight as HWIO); both optimizers fresh.
    start = states[4]
    assert not any(before[name].any() for name in adapters)
    for side in (start["reference_state"], {n[4:]: v for n, v in start["program_state"].items()}):
        assert not torch.equal(side[head[0]], before[head[0]])
        assert not any(side[name].any() for name in adapters)
    assert start["reference_optimizer"]["state"] == {}
    assert float(start["program_state"]["qnn_convbwd_optim_step"]) == 0
    # After it: the adapters and the head moved on.
    trained = torch.load(out / "model.pt")
    for name in [*adapters, *head]:
        assert not torch.equal(trained[name], start["reference_state"][name]), name
    assert not torch.equal(trained[head[0]], start["program_state"][program])


def _resumed_from(checkpoint: bytes, finished: Path, out: Path) -> tuple[str, int]:
    """A copy of the finished run's folder holding ``checkpoint`` and no outputs, resumed:
    the printed output and how many training programs the resumed run lowered."""
    from qnn_convbwd import training

    shutil.copytree(finished, out)
    (out / finetune.CHECKPOINT_FILE).write_bytes(checkpoint)
    for name in ("report.json", "model.pt", "train.pte", "infer.pte", "curves.png"):
        (out / name).unlink()
    lowered = []
    lower = training.lower_for_training

    def counting(*args, **kwargs):
        lowered.append(kwargs["optimizer"])
        return lower(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(training, "lower_for_training", counting)
        code, printed = _main(["finetune", "--resume", str(out)])
    assert code == 0, printed
    return printed, len(lowered)


@pytest.mark.parametrize("step", [8, HEAD_STEPS, 24])
def test_a_resume_in_either_phase_ends_as_the_straight_run(adapted, tmp_path, step):
    """``--resume`` from a checkpoint in the head's phase, at the start of the adapters'
    and in the middle of it goes on in that phase, and ends with the straight run's
    losses, evaluations and weights, to the bit."""
    out, _, written = adapted
    checkpoint = next(data for data in written if _checkpoint(data)["step"] == step)
    resumed = tmp_path / "run"
    printed, lowered = _resumed_from(checkpoint, out, resumed)
    # From the head's phase both programs are lowered; from the adapters' that one alone.
    assert lowered == (2 if step < HEAD_STEPS else 1)
    assert f"resuming {resumed} after step {step} of {HEAD_STEPS + STEPS}" in printed
    a = json.loads((resumed / "report.json").read_text())
    b = json.loads((out / "report.json").read_text())
    assert a["losses"] == b["losses"] and a["torch_losses"] == b["torch_losses"]
    assert a["evaluations"] == b["evaluations"]
    drop = ("lowering_seconds",)
    assert [{k: v for k, v in p.items() if k not in drop} for p in a["phases"]] == [
        {k: v for k, v in p.items() if k not in drop} for p in b["phases"]
    ]
    ours, theirs = torch.load(resumed / "model.pt"), torch.load(out / "model.pt")
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_head_epochs_0_trains_the_adapters_from_the_first_step(folders, tmp_path, qnn_sdk):
    """``--head-epochs 0``: one phase, the adapters and the head from the first step at
    the default ``--lr`` 0.02, as the tool trained them before it had a warm start."""
    args = adapter_args(folders, tmp_path / "run", "--head-epochs", "0", "--no-torch")
    del args[args.index("--lr") : args.index("--lr") + 2]
    printed, written = recorded_run(args)
    assert "head alone" not in printed
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert [(p["trains"], p["first"], p["steps"]) for p in report["phases"]] == [
        ("adapter", 0, STEPS)
    ]
    assert report["optimizer"]["lr"] == report["phases"][0]["optimizer"]["lr"] == 0.02
    first = _checkpoint(written[0])
    assert (first["phase"], first["step"]) == (0, 4)
    adapters = [n for n in first["program_state"] if ".adapter.weight" in n]
    assert len(adapters) == finetune.ADAPTED_BLOCKS
    assert all(first["program_state"][n].any() for n in adapters)  # trained from step 1


def _options(*argv: str):
    import argparse

    from qnn_convbwd.commands import finetune_cli

    parser = argparse.ArgumentParser()
    finetune_cli.add_arguments(parser)
    args = parser.parse_args(list(argv))
    if args.scheme is None:
        args.scheme = finetune.QUANTIZED_SCHEME if args.quantize else "full"
    finetune_cli._warm_start_options(args)
    return args.head_epochs, args.head_lr, args.lr


def test_the_warm_start_defaults_and_refusals():
    """One epoch of the head at 0.02 then 0.005 for adapters in a quantized backbone;
    no warm start (and 0.02) otherwise; a warm start refused where it means nothing."""
    from qnn_convbwd.commands.finetune_cli import UsageError

    quantized_adapters = ("--quantize", "8a8w", "--scheme", "adapter")
    assert _options(*quantized_adapters) == (1, 0.02, 0.005)
    assert _options(*quantized_adapters, "--head-epochs", "0") == (0, None, 0.02)
    assert _options(*quantized_adapters, "--head-lr", "0.01", "--lr", "0.001") == (1, 0.01, 0.001)
    assert _options("--scheme", "adapter") == (0, None, 0.02)
    assert _options("--quantize", "8a8w") == (0, None, 0.02)
    assert _options("--scheme", "full", "--head-epochs", "2") == (2, 0.02, 0.02)
    with pytest.raises(UsageError, match="--head-epochs 1 with --scheme head: it trains the head"):
        _options("--quantize", "8a8w", "--head-epochs", "1")
    with pytest.raises(UsageError, match="--head-lr is the warm start's rate"):
        _options("--head-lr", "0.1")
    with pytest.raises(UsageError, match="--head-epochs -1: 0 or more"):
        _options("--head-epochs", "-1")
