"""``qnn-convbwd finetune`` on a user's data: inputs, outputs, checkpoints and resume,
bad input.

The runs train a small ConvBn net (``--model test_finetune_tool:small_model``) on
tiny ImageFolders of PNGs made from scikit-learn's digits at 8x8, as the CPU-only
program (SM8350), so they lower in seconds. One finished run (``finished``, made by
conftest's ``finetune_run``) is shared by the output tests and test_device_train;
the resume test kills a second run with SIGKILL and compares the resumed run with it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from qnn_convbwd import cli, finetune, finetune_data, training
from qnn_convbwd.commands import finetune_cli
from qnn_convbwd.passes import filter_storage

HERE = Path(__file__).resolve().parent
MODEL = "test_finetune_tool:small_model"
SIZE, BATCH, STEPS = 8, 4, 60


def small_model(num_classes: int = 10, dropout: float | None = 0.25) -> nn.Module:
    """Two strided ConvBn blocks, average pool, dropout (none when ``dropout`` is None)
    and a linear head."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        *([] if dropout is None else [nn.Dropout(dropout)]),
        nn.Linear(16, num_classes),
    )


def other_model(num_classes: int = 10) -> nn.Module:
    """Another architecture: one convolution, no batch norm."""
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, num_classes),
    )


def make_folder(root: Path, per_class: int, offset: int = 0, classes: int = 4) -> Path:
    """``root/<digit>/<i>.png``: ``per_class`` of scikit-learn's digits 0..classes-1 as
    8-bit grey PNGs, skipping the first ``offset`` of each."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    for label in range(classes):
        folder = root / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        chosen = np.flatnonzero(digits.target == label)[offset : offset + per_class]
        for index in chosen:
            pixels = (digits.images[index] * 255 / 16).astype(np.uint8)
            Image.fromarray(pixels).save(folder / f"{index}.png")
    return root


@pytest.fixture(scope="module")
def folders(finetune_run):
    """The training and held-out folders of the finished run."""
    return finetune_run[0]


def run_args(train: Path, val: Path, out: Path) -> list[str]:
    return [
        "finetune", "--model", MODEL, "--data", str(train), "--val", str(val),
        "--size", str(SIZE), "--batch", str(BATCH), "--steps", str(STEPS), "--cpu",
        "--lr", "0.05", "--lr-schedule", "cosine", "--checkpoint-every", "10",
        "--out", str(out),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def finished(finetune_run):
    """One uninterrupted run with the torch copy, ``run_args`` on ``folders`` (conftest's
    ``finetune_run``, shared with test_device_train): (out folder, printed output)."""
    _, out, printed = finetune_run
    return out, printed


def _main(argv: list[str]) -> tuple[int, str]:
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = cli.main(argv)
    return code, buffer.getvalue()


def _val(folders, report: dict) -> tuple[torch.Tensor, torch.Tensor]:
    data = finetune_data.load(folders[1], SIZE, classes=report["classes"])
    normalize = finetune_data.Normalize(report["normalize"]["mean"], report["normalize"]["std"])
    return normalize(data.x), data.y


# --- inputs ---------------------------------------------------------------------------


def test_image_folder_reads_resizes_and_labels_by_sorted_folder(tmp_path):
    root = make_folder(tmp_path / "d", 3, classes=3)
    data = finetune_data.image_folder(root, 12)
    assert data.classes == ["0", "1", "2"] and data.x.shape == (9, 3, 12, 12)
    assert data.y.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert 0.0 <= float(data.x.min()) and float(data.x.max()) <= 1.0
    assert torch.equal(data.x[:, 0], data.x[:, 2])  # grey PNGs become equal RGB channels
    # Held-out data keeps the training data's class order and indices.
    (tmp_path / "v" / "2").mkdir(parents=True)
    (root / "2").joinpath(next(iter(os.listdir(root / "2")))).rename(tmp_path / "v" / "2" / "a.png")
    assert finetune_data.image_folder(tmp_path / "v", 12, data.classes).y.tolist() == [2]


@pytest.mark.parametrize("suffix", [".pt", ".npz"])
def test_tensor_file_uint8_and_grey_images(tmp_path, suffix):
    x = torch.randint(0, 256, (6, 1, 5, 5), dtype=torch.uint8)
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    path = tmp_path / f"data{suffix}"
    if suffix == ".pt":
        torch.save({"x": x, "y": y}, path)
    else:
        np.savez(path, x=x.numpy(), y=y.numpy())
    data = finetune_data.load(path, 5)
    assert data.classes == ["0", "1", "2"] and torch.equal(data.y, y)
    assert torch.equal(data.x[:, 1], x[:, 0].float() / 255)
    assert finetune_data.load(path, 10).x.shape == (6, 3, 10, 10)


def test_holdout_and_normalize():
    data = finetune_data.Dataset(torch.rand(20, 3, 4, 4), torch.arange(20) % 2, ["a", "b"])
    kept, held = finetune_data.holdout(data, 0.25, seed=1)
    assert len(kept) == 15 and len(held) == 5
    assert sorted(torch.cat([kept.x, held.x]).flatten().tolist()) == sorted(
        data.x.flatten().tolist()
    )
    normalize = finetune_data.Normalize.of(kept.x)
    out = normalize(kept.x)
    assert torch.allclose(out.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-5)
    assert torch.allclose(out.std(dim=(0, 2, 3)), torch.ones(3), atol=1e-5)


def test_weights_load_strictly_and_replace_a_classifier_of_another_class_count(tmp_path):
    source = small_model(num_classes=7)
    path = tmp_path / "w.pt"
    torch.save(source.state_dict(), path)
    net = small_model(num_classes=4)
    head = net[9].weight.detach().clone()
    news = finetune.load_weights(net, path)
    assert news == "classifier '9' replaced: the checkpoint has 7 classes, the data 4"
    assert torch.equal(net[0].weight, source[0].weight)
    assert torch.equal(net[4].running_var, source[4].running_var)
    assert torch.equal(net[9].weight, head)  # the new head kept
    same = small_model(num_classes=7)
    assert finetune.load_weights(same, path) is None
    assert torch.equal(same[9].weight, source[9].weight)


def test_user_model_gets_the_class_count():
    sys.path.insert(0, str(HERE))
    net = finetune.user_model(MODEL, 3, seed=0)
    assert net[9].out_features == 3
    with pytest.raises(finetune.ModelError, match="no function 'nothing'"):
        finetune.user_model("test_finetune_tool:nothing", 3)


def test_lr_schedules():
    assert [finetune.lr_factor("none", s, 4) for s in range(4)] == [1.0] * 4
    cosine = [finetune.lr_factor("cosine", s, 4) for s in range(4)]
    assert cosine[0] == 1.0 and cosine[2] == pytest.approx(0.5) and cosine[3] > 0
    assert [finetune.lr_factor("step", s, 8) for s in range(8)] == pytest.approx(
        [1, 1, 1, 1, 0.1, 0.1, 0.01, 0.01]
    )


# --- outputs --------------------------------------------------------------------------


def test_run_writes_its_outputs(finished, folders):
    out, printed = finished
    names = {p.name for p in out.iterdir()}
    assert names == {
        "model.pt", "train.pte", "infer.pte", "report.json", "curves.png",
        finetune.CHECKPOINT_FILE,
    }  # fmt: skip
    assert not [n for n in names if n.startswith(".")]  # no temporary file left
    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == STEPS and len(report["losses"]) == STEPS
    assert report["classes"] == ["0", "1", "2", "3"]
    assert report["args"]["lr_schedule"] == "cosine"
    # The optimizer the program applied (the default: SGD with momentum 0.9).
    assert report["optimizer"] == {
        "name": "sgd", "lr": 0.05, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.0,
        "nesterov": False,
    }  # fmt: skip
    assert report["program_optimizer"]["kind"] == "SGD"
    assert len(report["normalize"]["mean"]) == 3 and len(report["normalize"]["std"]) == 3
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"
    # The progress lines: step, loss, accuracy and the time left.
    header = next(line for line in printed.splitlines() if line.split()[:1] == ["step"])
    assert header.split()[-1] == "left" and "acc program" in header
    last = next(line for line in printed.splitlines() if line.split()[:1] == [str(STEPS)])
    assert last.split()[-1] == "0:00"


def test_model_pt_gives_the_reported_accuracy(finished, folders):
    out, _ = finished
    report = json.loads((out / "report.json").read_text())
    net = small_model(num_classes=4)
    net.load_state_dict(torch.load(out / "model.pt"))  # running statistics included
    assert int(net[1].num_batches_tracked) == STEPS
    x, y = _val(folders, report)
    with torch.no_grad():
        right = int((net.eval()(x).argmax(1) == y).sum())
    assert right / len(y) == report["val_accuracy"]
    # The program tracked torch (same optimizer and schedule on both sides).
    gaps = [abs(a - b) for a, b in zip(report["losses"], report["torch_losses"])]
    assert max(gaps) < 1e-4, gaps


def _train_pte_session(out: Path, report: dict) -> training.ProgramOptimizerSession:
    """A session on train.pte alone (no layout given), its optimizer read from the report."""
    optimizer = training.ProgramOptimizer.from_dict(report["program_optimizer"])
    return training.ProgramOptimizerSession((out / "train.pte").read_bytes(), optimizer)


def test_train_pte_starts_from_the_trained_weights(finished, folders):
    """A session on train.pte holds model.pt's values under the module's names, the
    optimizer's momentum as the last checkpoint's run went on to hold it, the base
    learning rate, and its first step computes the eager model's loss with the masks of
    the program's next dropout step."""
    from qnn_convbwd.passes import dropout
    from qnn_convbwd.passes import optimizer as optimizer_pass

    out, _ = finished
    report = json.loads((out / "report.json").read_text())
    trained = torch.load(out / "model.pt")
    session = _train_pte_session(out, report)
    try:
        program = session.state_dict()
        assert set(program) == set(trained)
        for name, value in trained.items():
            assert torch.equal(program[name], value), name
        kept = session.program_state()
        assert int(kept["qnn_convbwd_dropout_step"]) == STEPS
        assert float(kept[optimizer_pass.STEP_BUFFER]) == STEPS
        assert session.lr == 0.05  # the base rate, not the schedule's last
        momentum = session.optimizer_state_dict()["state"]
        assert momentum and all(
            float(m["momentum_buffer"].abs().sum()) > 0 for m in momentum.values()
        )
        net = small_model(num_classes=4)
        net.load_state_dict(trained)
        x, y = _val(folders, report)
        x, y = x[:BATCH], y[:BATCH]
        loss = nn.CrossEntropyLoss()
        joint = training.export_joint(training.WithLoss(small_model(4), loss), (x, y))
        _, sites = dropout.rewrite(joint, report["args"]["seed"])
        with torch.no_grad(), dropout.ProgramMasks(sites, STEPS):
            eager = float(loss(net.train()(x), y))
        assert session.step([x, y]) == pytest.approx(eager, rel=1e-5)
    finally:
        session.close()


def test_train_pte_alone_trains_in_executorchs_runtime(finished, folders):
    """``executorch.runtime`` with no optimizer code: each ``forward([x, y])`` of
    train.pte is one training step; its losses change from step to step and equal a
    ProgramOptimizerSession's on the same program, bit for bit."""
    from executorch.runtime import Runtime

    out, _ = finished
    report = json.loads((out / "report.json").read_text())
    x, y = _val(folders, report)
    batches = [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, 3 * BATCH, BATCH)]
    pte = (out / "train.pte").read_bytes()
    method = Runtime.get().load_program(pte).load_method("forward")
    losses = [float(method.execute([bx, by])[0]) for bx, by in batches]
    session = _train_pte_session(out, report)
    try:
        expected = [session.step([bx, by]) for bx, by in batches]
    finally:
        session.close()
    assert losses == expected
    assert len(set(losses)) == len(losses)
    # A batch of another size is refused before the runtime sees it.
    session = _train_pte_session(out, report)
    try:
        with pytest.raises(ValueError, match=r"input 0: shape \(5, 3, 8, 8\), the program takes"):
            session.step([x[: BATCH + 1], y[: BATCH + 1]])
    finally:
        session.close()


def test_infer_pte_predicts_as_the_eager_model(finished, folders):
    from qnn_convbwd.toolchain import harness

    out, _ = finished
    report = json.loads((out / "report.json").read_text())
    assert report["delegates"]["infer"] >= 1
    net = small_model(num_classes=4)
    net.load_state_dict(torch.load(out / "model.pt"))
    x, _ = _val(folders, report)
    pte = (out / "infer.pte").read_bytes()
    with torch.no_grad():
        eager = net.eval()(x)
    logits = torch.cat([harness.run_pte(pte, [image[None]])[0] for image in x])
    assert torch.allclose(logits, eager, atol=2e-2), (logits - eager).abs().max()
    assert (logits.argmax(1) == eager.argmax(1)).float().mean() >= 0.95


def test_checkpoint_holds_the_momentum_and_the_scheduled_rate(finished):
    """The in-program SGD's state, in torch.optim's format and as the program's own
    buffers (which a resume loads)."""
    from qnn_convbwd.passes import optimizer as optimizer_pass

    out, _ = finished
    state = torch.load(out / finetune.CHECKPOINT_FILE, weights_only=True)
    step = state["step"]
    kept = state["program_state"]
    assert float(kept[optimizer_pass.STEP_BUFFER]) == step
    assert float(kept[optimizer_pass.LR_BUFFER]) == 0.05 * finetune.lr_factor(
        "cosine", step - 1, STEPS
    )
    # The program keeps a trained convolution weight's state in the weight's stored
    # layout (HWIO); torch.optim's format has torch's.
    names = json.loads((out / "report.json").read_text())["program_optimizer"]["parameters"]
    stored = training.stored_layouts((out / "train.pte").read_bytes())
    assert stored  # the small model's convolution weights
    for index, entry in state["program_optimizer"]["state"].items():
        buffer = kept[f"{optimizer_pass.PREFIX}{index}_momentum_buffer"]
        buffer = filter_storage.torch_view(buffer, stored.get(names[int(index)]))
        assert torch.equal(entry["momentum_buffer"], buffer)
    assert step == STEPS - 10  # every 10 steps, the last one before the end
    momentum = state["program_optimizer"]["state"]
    assert len(momentum) == len(state["program_optimizer"]["param_groups"][0]["params"])
    assert all(s["momentum_buffer"].abs().sum() > 0 for s in momentum.values())
    rate = state["program_optimizer"]["param_groups"][0]["lr"]
    assert rate == 0.05 * finetune.lr_factor("cosine", step - 1, STEPS)
    # The program's dropout masks go on from the step counter it carries.
    assert int(state["program_state"]["qnn_convbwd_dropout_step"]) == step
    assert len(state["steps"]) == step


# --- resume ---------------------------------------------------------------------------


def _command(argv: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)
    code = "import sys; from qnn_convbwd import cli; sys.exit(cli.main(sys.argv[1:]))"
    with open(log, "w") as file:
        return subprocess.Popen(
            [sys.executable, "-c", code, *argv], stdout=file, stderr=subprocess.STDOUT, env=env
        )


def _same_run(ours: Path, theirs: Path) -> None:
    a = json.loads((ours / "report.json").read_text())
    b = json.loads((theirs / "report.json").read_text())
    assert a["losses"] == b["losses"]  # floats as JSON prints them: every bit
    assert a["torch_losses"] == b["torch_losses"]
    assert a["val_accuracy"] == b["val_accuracy"] and a["evaluations"] == b["evaluations"]
    trained, straight = torch.load(ours / "model.pt"), torch.load(theirs / "model.pt")
    assert set(trained) == set(straight)
    assert all(torch.equal(trained[k], straight[k]) for k in straight)


def test_resume_from_the_last_checkpoint_ends_as_the_run(finished, tmp_path):
    """``--resume`` on a copy of the finished run: from its last checkpoint (momentum,
    schedule, running statistics, torch's copy) to the same losses and weights."""
    out = tmp_path / "run"
    shutil.copytree(finished[0], out)
    for name in ("report.json", "model.pt", "train.pte", "infer.pte"):
        (out / name).unlink()
    code, printed = _main(["finetune", "--resume", str(out)])
    assert code == 0, printed
    assert f"resuming {out} after step {STEPS - 10} of {STEPS}" in printed
    _same_run(out, finished[0])


@pytest.mark.slow(reason="two CPU-only lowerings in subprocesses, over a minute")
def test_a_killed_run_resumes_to_the_same_losses_to_the_bit(finished, folders, tmp_path):
    """SIGKILL after the first checkpoint; ``--resume`` ends with every loss and every
    trained tensor equal to the uninterrupted run's."""
    out = tmp_path / "run"
    killed = _command(run_args(*folders, out), tmp_path / "killed.log")
    checkpoint = out / finetune.CHECKPOINT_FILE
    deadline = time.monotonic() + 1800
    while not checkpoint.exists() and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    log = (tmp_path / "killed.log").read_text()
    assert killed.returncode == -signal.SIGKILL, log
    assert checkpoint.exists() and not (out / "report.json").exists(), log
    stopped = torch.load(checkpoint, weights_only=True)["step"]
    assert 0 < stopped < STEPS

    resumed = _command(["finetune", "--resume", str(out)], tmp_path / "resumed.log")
    assert resumed.wait(timeout=1800) == 0, (tmp_path / "resumed.log").read_text()
    assert f"resuming {out} after step {stopped}" in (tmp_path / "resumed.log").read_text()
    _same_run(out, finished[0])


def test_a_warm_start_carries_the_weights_statistics_and_dropout_masks_on(qnn_sdk):
    """``fit(scheme="full", head_epochs=1)``: an epoch of the head alone, then every
    parameter with a fresh optimizer. The running statistics count the steps of both
    phases, the program's dropout masks go on from the head's phase (its counter holds
    every step), and the torch copy, dropping what the program drops in both, keeps its
    losses within 1e-4 of the program's."""
    split = finetune.digits(SIZE, seed=0)
    train = split.train[0][:24], split.train[1][:24]
    result = finetune.fit(
        small_model(10), train, split.test, scheme="full", batch=BATCH, steps=6, lr=0.05,
        momentum=0.9, lr_schedule="cosine", cpu_only=True, head_epochs=1,
    )  # fmt: skip
    per_epoch = 24 // BATCH
    phases = [(p.trains, p.first, p.steps, p.lr_schedule) for p in result.phases]
    assert phases == [("head", 0, per_epoch, "none"), ("full", per_epoch, 6, "cosine")]
    assert [p.optimizer["lr"] for p in result.phases] == [finetune.HEAD_LR, 0.05]
    assert result.phases[0].trainable == 16 * 10 + 10  # the linear head
    assert int(result.program_state["1.num_batches_tracked"]) == per_epoch + 6
    gaps = [abs(s.program_loss - s.torch_loss) for s in result.steps]
    assert len(gaps) == per_epoch + 6 and max(gaps) < 1e-4, gaps
    assert int(result.program_final["qnn_convbwd_dropout_step"]) == per_epoch + 6
    # Evaluated before, after the head's phase and at the end.
    assert [e.step for e in result.evaluations] == [0, per_epoch, per_epoch + 6]
    # The mean step time leaves out each phase's first step (its program's load).
    timed = [s.seconds for i, s in enumerate(result.steps) if i not in (0, per_epoch)]
    assert result.mean_step_seconds == sum(timed) / len(timed)


# --- bad input ------------------------------------------------------------------------


def _refused(argv: list[str], capsys, out: Path | None = None) -> str:
    code = cli.main(argv)
    captured = capsys.readouterr()
    assert code == 2, captured
    assert "Traceback" not in captured.err and len(captured.err.strip().splitlines()) == 1
    if out is not None:
        assert not out.exists()
    return captured.err


def _args(data: Path, out: Path, *more: str) -> list[str]:
    sys.path.insert(0, str(HERE))
    return ["finetune", "--model", MODEL, "--data", str(data), "--size", str(SIZE),
            "--cpu", "--out", str(out), *more]  # fmt: skip


def test_an_empty_or_unreadable_image_is_named(tmp_path, capsys):
    data = make_folder(tmp_path / "d", 4, classes=2)
    empty = data / "1" / "empty.png"
    empty.write_bytes(b"")
    assert f"{empty}: empty file" in _refused(_args(data, tmp_path / "o"), capsys, tmp_path / "o")
    empty.write_bytes(b"not a png at all")
    err = _refused(_args(data, tmp_path / "o"), capsys, tmp_path / "o")
    assert f"{empty}: not a readable image" in err


def test_a_class_folder_without_images(tmp_path, capsys):
    data = make_folder(tmp_path / "d", 4, classes=2)
    (data / "7").mkdir()
    (data / "7" / "notes.txt").write_text("no image here")
    err = _refused(_args(data, tmp_path / "o"), capsys, tmp_path / "o")
    assert f"{data / '7'}: class folder without images" in err


def test_weights_of_another_architecture_list_the_names(tmp_path, capsys):
    data = make_folder(tmp_path / "d", 4, classes=2)
    weights = tmp_path / "other.pt"
    torch.save(other_model(2).state_dict(), weights)
    err = _refused(_args(data, tmp_path / "o", "--weights", str(weights)), capsys, tmp_path / "o")
    assert "not a checkpoint of this architecture" in err
    assert "not in the checkpoint: 1.bias, 1.num_batches_tracked, 1.running_mean" in err
    assert "9.weight" in err and "not in the model" not in err
    assert "other shapes: 0.bias (4,) vs (8,), 0.weight (4, 3, 3, 3) vs (8, 3, 3, 3)" in err


def test_an_out_folder_with_a_run_needs_resume_or_overwrite(tmp_path, capsys):
    data = make_folder(tmp_path / "d", 4, classes=2)
    out = tmp_path / "o"
    out.mkdir()
    (out / "report.json").write_text("{}")
    err = _refused(_args(data, out), capsys)
    assert "already holds a run (report.json)" in err and "--overwrite" in err
    assert [p.name for p in out.iterdir()] == ["report.json"]


def test_a_size_the_model_cannot_take(tmp_path, capsys):
    data = make_folder(tmp_path / "d", 4, classes=2)
    argv = ["finetune", "--arch", "cifar", "--data", str(data), "--size", "16", "--cpu",
            "--out", str(tmp_path / "o")]  # fmt: skip
    err = _refused(argv, capsys, tmp_path / "o")
    assert "--size 16: CIFAR10Model cannot take 16x16 images" in err


def test_momentum_with_adamw_is_refused(tmp_path, capsys):
    data = make_folder(tmp_path / "d", 4, classes=2)
    argv = _args(data, tmp_path / "o", "--optimizer", "adamw", "--momentum", "0.9")
    err = _refused(argv, capsys, tmp_path / "o")
    assert "--momentum is SGD's: --optimizer adamw takes none" in err


def test_resume_without_a_checkpoint(tmp_path, capsys):
    err = _refused(["finetune", "--resume", str(tmp_path)], capsys)
    assert f"--resume {tmp_path}: no {finetune.CHECKPOINT_FILE} there" in err


def test_a_checkpoint_of_another_format_is_refused(tmp_path, capsys):
    torch.save({"format": "qnn-convbwd finetune checkpoint 1"}, tmp_path / finetune.CHECKPOINT_FILE)
    err = _refused(["finetune", "--resume", str(tmp_path)], capsys)
    assert "a checkpoint of format 'qnn-convbwd finetune checkpoint 1'" in err
    assert repr(finetune.CHECKPOINT_FORMAT) in err


def test_prepare_reports_the_replaced_classifier(tmp_path):
    data = make_folder(tmp_path / "d", 4, classes=2)
    weights = tmp_path / "w.pt"
    torch.save(small_model(10).state_dict(), weights)
    sys.path.insert(0, str(HERE))
    parser = __import__("argparse").ArgumentParser()
    finetune_cli.add_arguments(parser)
    argv = _args(data, tmp_path / "o", "--weights", str(weights), "--batch", "4")
    args = parser.parse_args(argv[1:])
    inputs = finetune_cli.prepare(args)
    assert "classifier '9' replaced: the checkpoint has 10 classes, the data 2" in inputs.notes[1]
    assert inputs.model[9].out_features == 2 and not (tmp_path / "o").exists()
