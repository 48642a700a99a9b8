"""scripts/run_on_device.py: dry run, prerequisite errors, the adb sequence, the real build.

No device is attached here: the dry run and the validation errors are checked on
the script's own output, the execute() sequence against a fake adb that plays the
device (it writes the output files a runner would), and the built programs on the
x86-64 HTP simulator when the QNN toolchain is available.
"""

from __future__ import annotations

import functools
import importlib.util
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from qnn_convbwd import device
from qnn_convbwd_dev import models

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "run_on_device.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("run_on_device", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_training_graph = functools.cache(models.training_graph)


@pytest.fixture(autouse=True)
def one_export_per_graph(request, monkeypatch):
    """The dry runs all print the same demo graph: export it once. The real build
    (``htp``) exports its own, and compares with a fresh one."""
    if request.node.get_closest_marker("htp") is None:
        monkeypatch.setattr(models, "training_graph", _training_graph)


def make_sdk(root: Path, arch: int) -> Path:
    for lib in device.device_libraries(root, arch):
        lib.parent.mkdir(parents=True, exist_ok=True)
        lib.write_bytes(b"\x7fELF fake")
    return root


def make_build(root: Path) -> Path:
    for rel in (device.RUNNER_IN_BUILD, device.BACKEND_LIB_IN_BUILD):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"\x7fELF fake")
    return root


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A fake SDK for v81 and v75, a fake executorch build, no QNN/executorch env vars."""
    sdk = make_sdk(make_sdk(tmp_path / "qairt", 81), 75)
    build = make_build(tmp_path / "build-android")
    monkeypatch.delenv("QNN_SDK_ROOT", raising=False)
    monkeypatch.delenv("EXECUTORCH_BUILD_DIR", raising=False)
    return {"sdk": sdk, "build": build, "out": tmp_path / "out"}


def args(env, *extra: str) -> list[str]:
    base = ["--qnn-sdk", str(env["sdk"]), "--build-dir", str(env["build"])]
    return [*base, "--out", str(env["out"]), *extra]


def stderr_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


# --- dry run ---------------------------------------------------------------------------


@pytest.mark.parametrize(("soc", "arch"), [("SM8850", 81), ("SM8650", 75)])
def test_dry_run_lists_the_skel_of_the_socs_arch_and_builds_nothing(script, env, capsys, soc, arch):
    assert script.main(["--soc", soc, *args(env, "--dry-run")]) == 0
    out = capsys.readouterr().out
    commands = [shlex.split(line.strip()) for line in out.splitlines() if line.startswith("  adb ")]
    pushes = {Path(c[2]).name: c for c in commands if c[1] == "push"}
    ws = device.DEFAULT_WORKSPACE
    skel = env["sdk"] / f"lib/hexagon-v{arch}/unsigned/libQnnHtpV{arch}Skel.so"
    assert pushes[skel.name] == ["adb", "push", str(skel), f"{ws}/{skel.name}"]
    other = 75 if arch == 81 else 81
    assert f"V{other}" not in out and f"hexagon-v{other}" not in out
    for name in (
        "libQnnHtp.so",
        f"libQnnHtpV{arch}Stub.so",
        "libQnnHtpPrepare.so",
        "libQnnSystem.so",
    ):
        assert pushes[name][2] == str(env["sdk"] / "lib/aarch64-android" / name)
    assert pushes["qnn_executor_runner"][2] == str(env["build"] / device.RUNNER_IN_BUILD)
    assert pushes[device.BACKEND_LIB_NAME][2] == str(env["build"] / device.BACKEND_LIB_IN_BUILD)
    expected_files = {"htp.pte", "cpu.pte", "input_0_0.raw", "input_0_1.raw", "input_list.txt"}
    assert expected_files <= set(pushes)
    assert all(c[3].startswith(f"{ws}/") for c in pushes.values())

    runs = [c[2] for c in commands if c[1] == "shell" and "qnn_executor_runner " in c[2]]
    assert len(runs) == 2
    for program, line in zip(("htp", "cpu"), runs):
        assert f"cd {ws} &&" in line
        assert "export LD_LIBRARY_PATH=." in line and "export ADSP_LIBRARY_PATH=." in line
        assert f"--model_path {program}.pte" in line
        assert f"--output_folder_path {ws}/outputs_{program}" in line
        assert "--input_list_path input_list.txt" in line and "--iteration 20" in line
    pulls = [c for c in commands if c[1] == "pull"]
    assert [c[2] for c in pulls] == [f"{ws}/outputs_htp", f"{ws}/outputs_cpu"]
    assert not env["out"].exists()


def test_dry_run_passes_serial_host_and_iterations(script, env, capsys):
    extra = ("--dry-run", "-s", "R5CX", "-H", "lab-host", "--iterations", "7")
    assert script.main(["--soc", "SM8850", *args(env, *extra)]) == 0
    lines = [x.strip() for x in capsys.readouterr().out.splitlines() if x.startswith("  adb ")]
    assert lines and all(x.startswith("adb -H lab-host -s R5CX ") for x in lines)
    assert sum("--iteration 7" in x for x in lines) == 2


def test_dry_run_without_adb_on_path_still_prints(script, env, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert script.main(["--soc", "SM8850", *args(env, "--dry-run")]) == 0
    assert "adb (looked up on PATH when not a dry run)" in capsys.readouterr().out


def test_dry_run_without_sdk_or_build_prints_the_plan_and_marks_what_is_missing(
    script, env, capsys
):
    assert script.main(["--soc", "SM8850", "--out", str(env["out"]), "--dry-run"]) == 0
    captured = capsys.readouterr()
    out = captured.out.splitlines()
    sdk_libs = [line.strip() for line in out if line.startswith("  $QNN_SDK_ROOT/lib/")]
    assert sdk_libs == [
        f"{lib} [missing]" for lib in device.device_libraries(Path("$QNN_SDK_ROOT"), 81)
    ]
    assert "QNN SDK: $QNN_SDK_ROOT [missing]" in out
    runner = Path("$EXECUTORCH_BUILD_DIR") / device.RUNNER_IN_BUILD
    assert f"runner: {runner} [missing]" in out
    assert f"  {env['out'] / 'htp.pte'}" in out  # written by a run: not marked
    missing = out[out.index("missing (a run stops here with exit code 2):") + 1 :]
    assert [m.strip().split(" not found")[0] for m in missing] == [
        "QNN SDK",
        "qnn_executor_runner",
        "libqnn_executorch_backend.so",
    ]
    assert not captured.err.strip() or "error" not in captured.err
    assert not env["out"].exists()


def test_dry_run_with_an_sdk_lacking_the_socs_arch_marks_only_those_libraries(
    script, env, capsys, tmp_path
):
    only75 = make_sdk(tmp_path / "only75", 75)
    argv = ["--soc", "SM8850", "--qnn-sdk", str(only75), "--build-dir", str(env["build"])]
    assert script.main([*argv, "--dry-run"]) == 0
    out = capsys.readouterr().out
    marked = sorted(Path(line.split()[0]).name for line in out.splitlines() if "[missing]" in line)
    assert marked == ["libQnnHtpV81Skel.so", "libQnnHtpV81Stub.so"]
    assert "only75 lacks lib/aarch64-android/libQnnHtpV81Stub.so and 1 more" in out


def test_runner_found_by_search_and_backend_lib_beside_it(tmp_path):
    build = tmp_path / "b"
    runner = build / "somewhere/else/qnn_executor_runner"
    runner.parent.mkdir(parents=True)
    runner.write_bytes(b"x")
    (runner.parent / device.BACKEND_LIB_NAME).write_bytes(b"x")
    found = device.resolve_runner(None, build)
    assert found == runner
    assert device.resolve_backend_lib(None, None, found) == runner.parent / device.BACKEND_LIB_NAME


# --- prerequisite errors: exit 2, one line naming what is missing and how to provide it ---
# (checked with --build-only: a dry run reports them and exits 0, see below)


def test_unknown_soc(script, env, capsys):
    assert script.main(["--soc", "SM0000", *args(env, "--dry-run")]) == 2
    line = stderr_line(capsys)
    assert line.startswith("error: unknown SoC 'SM0000': pass --soc")
    assert "SM8850" in line and "SM8650" in line


def test_missing_sdk(script, env, capsys):
    argv = ["--soc", "SM8850", "--build-dir", str(env["build"]), "--build-only"]
    assert script.main(argv) == 2
    assert stderr_line(capsys) == (
        "error: QNN SDK not found: set QNN_SDK_ROOT or pass --qnn-sdk DIR "
        "(a QAIRT SDK with lib/aarch64-android and lib/hexagon-v81)"
    )


def test_sdk_from_environment_without_the_socs_arch(script, env, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("QNN_SDK_ROOT", str(make_sdk(tmp_path / "only75", 75)))
    argv = ["--soc", "SM8850", "--build-dir", str(env["build"]), "--build-only"]
    assert script.main(argv) == 2
    line = stderr_line(capsys)
    assert "only75 lacks lib/aarch64-android/libQnnHtpV81Stub.so and 1 more" in line
    assert "set QNN_SDK_ROOT or pass --qnn-sdk" in line


def test_missing_runner(script, env, capsys):
    argv = ["--soc", "SM8850", "--qnn-sdk", str(env["sdk"]), "--build-only"]
    assert script.main(argv) == 2
    assert stderr_line(capsys) == (
        "error: qnn_executor_runner not found: pass --runner PATH or --build-dir DIR "
        "(executorch 1.5.1 built for Android with -DEXECUTORCH_BUILD_QNN=ON)"
    )


def test_runner_path_that_does_not_exist(script, env, capsys, tmp_path):
    argv = ["--soc", "SM8850", "--qnn-sdk", str(env["sdk"]), "--runner", str(tmp_path / "nope")]
    assert script.main([*argv, "--build-only"]) == 2
    assert stderr_line(capsys).startswith(f"error: qnn_executor_runner not found at {tmp_path}")


def test_missing_backend_library(script, env, capsys, tmp_path):
    runner = tmp_path / "qnn_executor_runner"
    runner.write_bytes(b"x")
    argv = [
        "--soc",
        "SM8850",
        "--qnn-sdk",
        str(env["sdk"]),
        "--runner",
        str(runner),
        "--build-only",
    ]
    assert script.main(argv) == 2
    line = stderr_line(capsys)
    assert line.startswith("error: libqnn_executorch_backend.so not found")
    assert "--backend-lib PATH or --build-dir DIR" in line


def test_missing_adb(script, env, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert script.main(["--soc", "SM8850", *args(env)]) == 2
    assert stderr_line(capsys) == (
        "error: adb not found on PATH: install Android platform-tools or pass --adb PATH"
    )
    assert not env["out"].exists()  # checked before anything is built


def test_adb_path_that_does_not_exist(script, env, capsys, tmp_path):
    assert script.main(["--soc", "SM8850", *args(env, "--adb", str(tmp_path / "adb"))]) == 2
    assert stderr_line(capsys).startswith(f"error: adb not found at {tmp_path / 'adb'}:")


def test_the_script_exits_with_mains_code(env, monkeypatch, capsys):
    """``python scripts/run_on_device.py ...`` exits with main()'s code: the script's
    ``__main__`` block, run here (runpy) rather than in a fresh interpreter, which
    would spend most of the quick tier's budget importing torch and executorch."""
    argv = [str(SCRIPT), "--soc", "SM0000", *args(env, "--dry-run")]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    assert exited.value.code == 2
    assert "error: unknown SoC 'SM0000'" in capsys.readouterr().err.strip().splitlines()[-1]


# --- the adb sequence against a fake device ---------------------------------------------------


RUNNER_LOG = """\
I 00:00:00.012 executorch:qnn_executor_runner.cpp:182] Model file htp.pte is loaded.
I 00:00:00.410 executorch:qnn_executor_runner.cpp:470] 20 inference took 41.200000 ms, avg {avg} ms
I 00:00:00.412 executorch:qnn_executor_runner.cpp:540] 1 inference took 41.200000 ms, avg 41.2 ms
"""


def test_parse_latency_takes_the_per_execution_average():
    assert device.parse_latency(RUNNER_LOG.format(avg="2.060000"), 20) == pytest.approx(2.06)
    assert device.parse_latency("no timing here", 20) is None


def test_execute_pushes_runs_pulls_and_compares(tmp_path):
    setup = device.Setup(
        "SM8850", 81, tmp_path / "sdk", tmp_path / "qnn_executor_runner", tmp_path / "lib.so", "adb"
    )
    plan = device.Plan(setup, tmp_path / "out", num_inputs=2, iterations=20)
    reference = [torch.tensor(0.5), torch.arange(6.0).reshape(2, 3)]
    offsets = {"htp": 1e-3, "cpu": 0.0}
    latencies = {"htp": "0.500000", "cpu": "4.000000"}
    seen: list[list[str]] = []

    def fake_adb(cmd: list[str]) -> subprocess.CompletedProcess:
        seen.append(cmd)
        out = ""
        if cmd[1] == "shell" and "--model_path" in cmd[2]:
            program = cmd[2].split("--model_path ")[1].split(".pte")[0]
            out = RUNNER_LOG.format(avg=latencies[program])
        if cmd[1] == "pull":
            program = cmd[2].rsplit("_", 1)[1]
            target = Path(cmd[3]) / f"outputs_{program}"
            target.mkdir(parents=True)
            for j, ref in enumerate(reference):
                data = (ref + offsets[program]).numpy().astype(np.float32)
                data.tofile(target / f"output_0_{j}.raw")
            # An output beyond the signature (the runner writes every program output).
            np.zeros(3, np.float32).tofile(target / f"output_0_{len(reference)}.raw")
        return subprocess.CompletedProcess(cmd, 0, out, None)

    runs = device.execute(plan, reference, run=fake_adb)
    assert seen == plan.commands()
    assert seen[0][:2] == ["adb", "shell"] and "rm -rf" in seen[0][2]
    by = {r.program: r for r in runs}
    assert by["htp"].latency_ms == pytest.approx(0.5)
    assert by["cpu"].latency_ms == pytest.approx(4.0)
    assert by["htp"].max_abs_error == pytest.approx(1e-3, rel=1e-3)
    assert by["cpu"].max_abs_error == 0.0


def test_execute_reports_the_failing_adb_command(tmp_path):
    setup = device.Setup("SM8850", 81, tmp_path, tmp_path / "r", tmp_path / "l.so", "adb")
    plan = device.Plan(setup, tmp_path / "out", num_inputs=2)

    def offline(cmd):
        return subprocess.CompletedProcess(cmd, 1, "adb: no devices/emulators found\n", None)

    with pytest.raises(device.DeviceError, match="exit 1: adb shell .*no devices/emulators"):
        device.execute(plan, [torch.zeros(1)], run=offline)


# --- the real build (HTP compile) checked on the simulator -------------------------------------


@pytest.mark.htp
def test_build_only_writes_programs_that_match_torch(script, env, capsys, qnn_sdk, monkeypatch):
    from qnn_convbwd.toolchain import harness
    from qnn_convbwd_dev.models import training_graph

    # The host compile uses the active (x86-64) SDK; --qnn-sdk names the device one.
    monkeypatch.setenv("QNN_SDK_ROOT", str(qnn_sdk.root))
    assert script.main(["--soc", "SM8650", *args(env, "--build-only")]) == 0
    out = env["out"]
    graph = training_graph("demo", size=15)
    reference = graph.reference()
    x, target = graph.inputs
    assert (out / "input_list.txt").read_text() == "input_0_0.raw input_0_1.raw\n"
    raw = np.fromfile(out / "input_0_0.raw", dtype=np.float32)
    assert torch.equal(torch.from_numpy(raw).reshape(x.shape), x)
    for program, atol in (("htp", 1e-2), ("cpu", 1e-5)):
        outputs = harness.run_pte((out / f"{program}.pte").read_bytes(), graph.inputs)
        assert device.max_abs_error(outputs[: len(reference)], reference) < atol, program
    assert "QNN partitions" in capsys.readouterr().out
