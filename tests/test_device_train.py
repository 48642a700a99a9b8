"""``scripts/run_on_device.py train``: a finetune run's train.pte trained on a device.

No device here: a fake ``adb`` (``tests/fake_device/adb.py``, first on PATH) plays
the device in a local folder, and a fake runner (``tests/fake_device/
train_runner.py``) keeps the runner contract of ``qnn_convbwd.device_train`` with
executorch's own runtime on x86-64. The run is the CPU-only program (SM8350) of a
small ConvBn net with the in-program SGD, so no QNN library is needed: what comes
back from the "device" must equal, bit for bit, a local ``ProgramOptimizerSession``
on the same program and batches.
"""

from __future__ import annotations

import importlib.util
import json
import stat
import sys
from pathlib import Path

import pytest
import torch

from qnn_convbwd import device_train, training

HERE = Path(__file__).resolve().parent
SCRIPT = HERE.parent / "scripts" / "run_on_device.py"
FAKE = HERE / "fake_device"
STEPS = 3


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("run_on_device", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def executable(path: Path, body: str) -> Path:
    """A script run by this test's Python interpreter."""
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def python_file(path: Path, source: Path) -> Path:
    return executable(path, source.read_text())


@pytest.fixture(scope="module")
def run(finetune_run):
    """A finished ``qnn-convbwd finetune --cpu`` run (conftest's ``finetune_run``, shared
    with test_finetune_tool) and a data folder: the run's held-out folder, 4 classes x 5
    images, so 5 batches of 4."""
    (_, held_out), out, _ = finetune_run
    return out, held_out


@pytest.fixture
def device(tmp_path, monkeypatch):
    """The fake adb first on PATH, its device folder, and the fake runner."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python_file(bin_dir / "adb", FAKE / "adb.py")
    root = tmp_path / "device"
    root.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}:{__import__('os').environ['PATH']}")
    monkeypatch.setenv("FAKE_ADB_ROOT", str(root))
    runner = python_file(tmp_path / "train_runner", FAKE / "train_runner.py")
    return root, runner


def train_args(run, runner: Path, out: Path, *more: str) -> list[str]:
    folder, data = run
    return ["train", "--run", str(folder), "--data", str(data), "--steps", str(STEPS),
            "--runner", str(runner), "--out", str(out), "--workspace", "/data/local/tmp/ws",
            *more]  # fmt: skip


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_training_on_the_fake_device_equals_a_local_session(script, run, device, tmp_path):
    """Pushed, trained by the runner, pulled back: every loss, every trained tensor and
    every buffer of the program (optimizer state included) equal a local session's after
    the same steps on the same batches."""
    root, runner = device
    out = tmp_path / "out"
    assert script.main(train_args(run, runner, out)) == 0
    folder, data = run
    report = json.loads((folder / "report.json").read_text())
    session = training.ProgramOptimizerSession(
        (folder / "train.pte").read_bytes(),
        training.ProgramOptimizer.from_dict(report["program_optimizer"]),
    )
    try:
        local = device_train.load_run(folder)
        batches = device_train.batches(local, data, STEPS)
        expected = [session.step([x, y]) for x, y in batches]
        losses = json.loads((out / "losses.json").read_text())["losses"]
        assert losses == expected and len(set(losses)) == STEPS
        pulled = torch.load(out / "program_state.pt")
        state = session.program_state()
        assert set(pulled) == set(state)
        for name, value in state.items():
            assert value.dtype == pulled[name].dtype and torch.equal(pulled[name], value), name
        model = torch.load(out / "model.pt")
        before = torch.load(folder / "model.pt")
        assert set(model) == set(before)
        trained = session.state_dict()
        for name, value in trained.items():
            assert torch.equal(model[name], value), name
        assert not torch.equal(model["0.weight"], before["0.weight"])  # it trained
        assert int(model["1.num_batches_tracked"]) == int(before["1.num_batches_tracked"]) + STEPS
    finally:
        session.close()
    # The model.pt loads strictly into the eager model.
    from test_finetune_tool import small_model

    small_model(num_classes=4).load_state_dict(model)
    # What reached the device: the program, one input line per step, the dump list.
    workspace = root / "data" / "local" / "tmp" / "ws"
    assert (workspace / "train.pte").read_bytes() == (folder / "train.pte").read_bytes()
    lines = (workspace / "input_list.txt").read_text().splitlines()
    assert lines == [f"x_{k}.raw y_{k}.raw" for k in range(STEPS)]
    assert (workspace / "x_0.raw").stat().st_size == 4 * 3 * 8 * 8 * 4
    calls = (root / "calls.log").read_text()
    assert "./train_runner --model_path train.pte --input_list_path input_list.txt" in calls


def test_batches_follow_the_data_in_order_and_wrap(run):
    folder, data = run
    local = device_train.load_run(folder)
    first = device_train.batches(local, data, None)
    assert len(first) == 5 and all(len(y) == 4 for _, y in first)
    wrapped = device_train.batches(local, data, 7)
    assert torch.equal(wrapped[5][0], first[0][0]) and torch.equal(wrapped[6][1], first[1][1])
    # Normalised as the run's report says.
    report = json.loads((folder / "report.json").read_text())
    assert report["normalize"]["mean"] != [0.0, 0.0, 0.0]
    assert abs(float(torch.cat([x for x, _ in first]).mean())) < 0.2


def test_a_missing_artifact_is_named_and_nothing_is_written(script, run, device, tmp_path, capsys):
    _, runner = device
    folder = tmp_path / "partial"
    folder.mkdir()
    for name in ("report.json", "model.pt"):
        (folder / name).write_bytes((run[0] / name).read_bytes())
    out = tmp_path / "out"
    assert script.main(train_args((folder, run[1]), runner, out)) == 2
    assert one_error_line(capsys) == (
        f"error: --run {folder}: no train.pte there (a finetune --out folder)"
    )
    assert not out.exists()
    assert script.main(train_args(run, tmp_path / "no_runner", out)) == 2
    assert one_error_line(capsys) == f"error: --runner {tmp_path / 'no_runner'}: no such file"
    assert script.main(train_args((run[0], tmp_path / "nothing.pt"), runner, out)) == 2
    assert "nothing.pt: no such file or folder" in one_error_line(capsys)
    assert not out.exists()


def test_a_failing_runner_gives_its_exit_and_last_lines(script, run, device, tmp_path, capsys):
    failing = executable(
        tmp_path / "bad_runner",
        "print('loading train.pte')\nprint('Error: 0x12')\nraise SystemExit(3)\n",
    )
    out = tmp_path / "out"
    assert script.main(train_args(run, failing, out)) == 1
    line = one_error_line(capsys)
    assert line.startswith("error: device run failed: exit 3: ")
    assert "/adb shell 'cd /data/local/tmp/ws && " in line
    assert line.endswith("loading train.pte | Error: 0x12")
    assert not (out / "model.pt").exists() and not (out / "losses.json").exists()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("", "the runner wrote no output_0_0.raw"),
        (
            "out.joinpath('output_0_0.raw').write_bytes(bytes(8))\n",
            "output_0_0.raw: 8 bytes, expected 4 (torch.float32 [1])",
        ),
    ],
)
def test_malformed_outputs_are_named(script, run, device, tmp_path, capsys, body, message):
    runner = executable(
        tmp_path / "lazy_runner",
        "import sys\nfrom pathlib import Path\n"
        "out = Path(sys.argv[sys.argv.index('--output_folder_path') + 1])\n"
        "out.mkdir(parents=True, exist_ok=True)\n" + body,
    )
    out = tmp_path / "out"
    assert script.main(train_args(run, runner, out)) == 1
    line = one_error_line(capsys)
    assert line.startswith("error: device run failed: ") and message in line
    assert not (out / "model.pt").exists()


def test_adb_not_on_path(script, run, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    runner = executable(tmp_path / "r", "")
    assert script.main(train_args(run, runner, tmp_path / "out")) == 2
    assert one_error_line(capsys).startswith("error: adb not found on PATH")


def test_a_ptd_is_pushed_and_passed_to_the_runner(run, tmp_path):
    local = device_train.load_run(run[0])
    ptd = tmp_path / "train.ptd"
    ptd.write_bytes(b"data")
    local.ptd = ptd
    plan = device_train.Plan(local, tmp_path / "runner", tmp_path, 2, "/data/local/tmp/w")
    assert ptd in plan.push_files()
    assert "--data_path train.ptd" in plan.runner_shell()
