"""Run a lowered training graph on an Android device with executorch's qnn_executor_runner.

What goes to the device (the layout executorch 1.5.1's ``SimpleADB`` in
``backends/qualcomm/export_utils.py`` uses for the HTP backend; that class is
not used, only the facts):

* ``qnn_executor_runner`` and ``libqnn_executorch_backend.so`` from an
  executorch Android build (``-DEXECUTORCH_BUILD_QNN=ON``);
* from ``$QNN_SDK_ROOT/lib/aarch64-android``: ``libQnnHtp.so``,
  ``libQnnHtpV<arch>Stub.so``, ``libQnnHtpPrepare.so``, ``libQnnSystem.so``;
* from ``$QNN_SDK_ROOT/lib/hexagon-v<arch>/unsigned``: ``libQnnHtpV<arch>Skel.so``,
  the DSP side, where ``<arch>`` is the SoC's HTP architecture;
* the programs, one raw file per input and ``input_list.txt`` naming them.

Everything lands in one device directory; the runner is started there with
``LD_LIBRARY_PATH=.`` (Android-side libraries) and ``ADSP_LIBRARY_PATH=.``
(where FastRPC looks for the skel). It writes ``output_<i>_<j>.raw`` per input
line ``i`` and output ``j`` and logs ``<n> inference took <t> ms, avg <a> ms``.

Two programs run: the graph lowered with the plugin (HTP) and the same graph
without any partitioner (all portable CPU kernels), for the latency comparison.

This module plans and executes; printing is the caller's job
(``scripts/run_on_device.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

TARGET = "aarch64-android"
RUNNER_NAME = "qnn_executor_runner"
RUNNER_IN_BUILD = Path("examples/qualcomm/executor_runner") / RUNNER_NAME
BACKEND_LIB_NAME = "libqnn_executorch_backend.so"
BACKEND_LIB_IN_BUILD = Path("backends/qualcomm") / BACKEND_LIB_NAME
DEFAULT_WORKSPACE = "/data/local/tmp/qnn_convbwd"
PROGRAMS = ("htp", "cpu")  # program names: <name>.pte, outputs_<name>/
INPUT_LIST = "input_list.txt"
_LATENCY = re.compile(r"(\d+) inference took ([\d.]+) ms, avg ([\d.]+) ms")


class SetupError(Exception):
    """A missing prerequisite; the message names it and how to provide it (one line)."""


class DeviceError(RuntimeError):
    """An adb command or the runner failed on the device."""


# --- prerequisites ---------------------------------------------------------------------


def soc_arch(soc: str) -> int:
    """The HTP architecture number (e.g. 81) of a SoC executorch knows."""
    from executorch.backends.qualcomm.utils.utils import get_soc_to_htp_arch_map

    known = get_soc_to_htp_arch_map()
    if soc not in known:
        names = ", ".join(sorted(known))
        raise SetupError(f"unknown SoC {soc!r}: pass --soc with one executorch knows ({names})")
    return int(known[soc].value)


def device_libraries(sdk: Path, arch: int) -> list[Path]:
    """The QNN runtime libraries the HTP backend needs on the device."""
    lib = sdk / "lib" / TARGET
    return [
        lib / "libQnnHtp.so",
        lib / f"libQnnHtpV{arch}Stub.so",
        lib / "libQnnHtpPrepare.so",
        lib / "libQnnSystem.so",
        sdk / "lib" / f"hexagon-v{arch}" / "unsigned" / f"libQnnHtpV{arch}Skel.so",
    ]


def resolve_sdk(path: str | os.PathLike | None, arch: int) -> Path:
    """The QNN SDK root holding the device libraries for ``arch``."""
    if not path:
        raise SetupError(
            "QNN SDK not found: set QNN_SDK_ROOT or pass --qnn-sdk DIR "
            f"(a QAIRT SDK with lib/{TARGET} and lib/hexagon-v{arch})"
        )
    root = Path(path)
    missing = [p for p in device_libraries(root, arch) if not p.is_file()]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise SetupError(
            f"QNN SDK at {root} lacks {missing[0].relative_to(root)}{more}: set QNN_SDK_ROOT or "
            f"pass --qnn-sdk with a full QAIRT SDK (lib/{TARGET}, lib/hexagon-v{arch})"
        )
    return root


def resolve_runner(runner: str | os.PathLike | None, build_dir: str | os.PathLike | None) -> Path:
    """``--runner`` if given, else ``qnn_executor_runner`` under the build directory."""
    how = (
        "pass --runner PATH or --build-dir DIR (executorch 1.5.1 built for Android "
        "with -DEXECUTORCH_BUILD_QNN=ON)"
    )
    if runner:
        if Path(runner).is_file():
            return Path(runner)
        raise SetupError(f"{RUNNER_NAME} not found at {runner}: {how}")
    if build_dir:
        build = Path(build_dir)
        if (build / RUNNER_IN_BUILD).is_file():
            return build / RUNNER_IN_BUILD
        found = sorted(p for p in build.rglob(RUNNER_NAME) if p.is_file()) if build.is_dir() else []
        if found:
            return found[0]
        raise SetupError(f"{RUNNER_NAME} not found under {build}: {how}")
    raise SetupError(f"{RUNNER_NAME} not found: {how}")


def resolve_backend_lib(
    backend_lib: str | os.PathLike | None,
    build_dir: str | os.PathLike | None,
    runner: Path,
) -> Path:
    """``libqnn_executorch_backend.so``: given, in the build dir, or beside the runner."""
    how = "pass --backend-lib PATH or --build-dir DIR"
    if backend_lib:
        if Path(backend_lib).is_file():
            return Path(backend_lib)
        raise SetupError(f"{BACKEND_LIB_NAME} not found at {backend_lib}: {how}")
    candidates = [runner.parent / BACKEND_LIB_NAME]
    if len(runner.parents) > 3:  # <build>/examples/qualcomm/executor_runner/<runner>
        candidates.append(runner.parents[3] / BACKEND_LIB_IN_BUILD)
    if build_dir:
        candidates.insert(0, Path(build_dir) / BACKEND_LIB_IN_BUILD)
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise SetupError(f"{BACKEND_LIB_NAME} not found next to {runner} or in the build dir: {how}")


def resolve_adb(adb: str | None) -> str:
    found = shutil.which(adb or "adb")
    if found is None:
        where = f"at {adb}" if adb else "on PATH"
        raise SetupError(
            f"adb not found {where}: install Android platform-tools or pass --adb PATH"
        )
    return found


@dataclasses.dataclass(frozen=True)
class Setup:
    soc: str
    arch: int
    sdk: Path
    runner: Path
    backend_lib: Path
    adb: str | None  # None: not looked up (dry run, build only)
    # Dry run only: the SetupError message of each prerequisite not found; its path
    # above is then the one a run would look at.
    missing: tuple[str, ...] = ()

    @property
    def libraries(self) -> list[Path]:
        return device_libraries(self.sdk, self.arch)


def check_setup(
    soc: str,
    qnn_sdk: str | os.PathLike | None,
    runner: str | os.PathLike | None = None,
    build_dir: str | os.PathLike | None = None,
    backend_lib: str | os.PathLike | None = None,
    adb: str | None = None,
    need_adb: bool = True,
    dry_run: bool = False,
) -> Setup:
    """Check every prerequisite before any work; SetupError names the first one missing.

    With ``dry_run`` a missing prerequisite (other than an unknown SoC) is no error:
    the Setup carries the path a run would look at and ``missing`` says what is
    missing and how to provide it.
    """
    arch = soc_arch(soc)
    missing: list[str] = []

    def resolve(find: Callable[[], Path], would_be: Path) -> Path:
        try:
            return find()
        except SetupError as err:
            if not dry_run:
                raise
            missing.append(str(err))
            return would_be

    sdk = resolve(lambda: resolve_sdk(qnn_sdk, arch), Path(qnn_sdk or "$QNN_SDK_ROOT"))
    build = Path(build_dir or "$EXECUTORCH_BUILD_DIR")
    runner_path = resolve(
        lambda: resolve_runner(runner, build_dir),
        Path(runner) if runner else build / RUNNER_IN_BUILD,
    )
    lib = resolve(
        lambda: resolve_backend_lib(backend_lib, build_dir, runner_path),
        Path(backend_lib) if backend_lib else build / BACKEND_LIB_IN_BUILD,
    )
    adb_path = resolve_adb(adb) if need_adb else None
    return Setup(soc, arch, sdk, runner_path, lib, adb_path, tuple(missing))


def sdk_build_id(sdk: Path) -> str | None:
    """QAIRT build id of the device ``libQnnHtp.so``, None if it carries none."""
    from .toolchain.sdk import SdkUnavailable, read_build_id

    try:
        return read_build_id(sdk / "lib" / TARGET / "libQnnHtp.so")
    except (SdkUnavailable, OSError, ValueError):
        return None


# --- the plan ----------------------------------------------------------------------------


@dataclasses.dataclass
class Plan:
    """Every file and adb command of one device run, in order."""

    setup: Setup
    out: Path  # host directory for programs, inputs and pulled outputs
    num_inputs: int
    iterations: int = 20
    workspace: str = DEFAULT_WORKSPACE
    serial: str | None = None
    adb_host: str | None = None

    def pte(self, program: str) -> Path:
        return self.out / f"{program}.pte"

    @property
    def input_files(self) -> list[Path]:
        return [self.out / f"input_0_{i}.raw" for i in range(self.num_inputs)]

    @property
    def input_list(self) -> Path:
        return self.out / INPUT_LIST

    def push_files(self) -> list[Path]:
        return [
            *(self.pte(p) for p in PROGRAMS),
            self.setup.runner,
            self.setup.backend_lib,
            *self.setup.libraries,
            *self.input_files,
            self.input_list,
        ]

    def adb(self, *args: str) -> list[str]:
        cmd = [self.setup.adb or "adb"]
        if self.adb_host:
            cmd += ["-H", self.adb_host]
        if self.serial:
            cmd += ["-s", self.serial]
        return [*cmd, *args]

    def runner_shell(self, program: str) -> str:
        """The shell line that runs one program on the device."""
        runner = self.setup.runner.name
        args = [
            f"--model_path {program}.pte",
            f"--output_folder_path {self.workspace}/outputs_{program}",
            f"--input_list_path {INPUT_LIST}",
            f"--iteration {self.iterations}",
        ]
        return (
            f"cd {self.workspace} && chmod +x {runner} && export LD_LIBRARY_PATH=. && "
            f"export ADSP_LIBRARY_PATH=. && ./{runner} {' '.join(args)}"
        )

    def prepare_commands(self) -> list[list[str]]:
        outputs = " ".join(f"{self.workspace}/outputs_{p}" for p in PROGRAMS)
        setup = self.adb("shell", f"rm -rf {self.workspace} && mkdir -p {outputs}")
        pushes = [self.adb("push", str(f), f"{self.workspace}/{f.name}") for f in self.push_files()]
        return [setup, *pushes]

    def run_command(self, program: str) -> list[str]:
        return self.adb("shell", self.runner_shell(program))

    def pull_command(self, program: str) -> list[str]:
        return self.adb("pull", f"{self.workspace}/outputs_{program}", str(self.out))

    def commands(self) -> list[list[str]]:
        cmds = self.prepare_commands()
        cmds += [self.run_command(p) for p in PROGRAMS]
        cmds += [self.pull_command(p) for p in PROGRAMS]
        return cmds

    def describe(self) -> list[str]:
        """Human-readable lines: every file used and every command, for ``--dry-run``.

        Prerequisites that do not exist are marked ``[missing]``; the programs and
        inputs a run writes are not.
        """
        setup = self.setup

        def mark(path: Path, exists: bool) -> str:
            return f"{path}" if exists else f"{path} [missing]"

        written = {*map(self.pte, PROGRAMS), *self.input_files, self.input_list}
        lines = [
            f"soc: {setup.soc} (HTP v{setup.arch})",
            f"QNN SDK: {mark(setup.sdk, setup.sdk.is_dir())}",
            f"runner: {mark(setup.runner, setup.runner.is_file())}",
            f"backend library: {mark(setup.backend_lib, setup.backend_lib.is_file())}",
            f"adb: {setup.adb or 'adb (looked up on PATH when not a dry run)'}",
            f"host directory: {self.out}",
            f"device directory: {self.workspace}",
            "files pushed:",
        ]
        lines += [f"  {mark(f, f in written or f.is_file())}" for f in self.push_files()]
        lines.append("commands:")
        lines += [f"  {shlex.join(c)}" for c in self.commands()]
        return lines


# --- building the programs -------------------------------------------------------------------


@dataclasses.dataclass
class Built:
    inputs: tuple[torch.Tensor, ...]
    reference: list[torch.Tensor]
    htp_partitions: int
    htp_seconds: float


def lower_cpu_only(program: torch.export.ExportedProgram) -> bytes:
    """The same graph without any partitioner: every node on executorch's portable CPU kernels."""
    from executorch.exir import to_edge_transform_and_lower

    return to_edge_transform_and_lower(program).to_executorch().buffer


def build(graph: Any, plan: Plan) -> Built:
    """Write the HTP and CPU-only programs, the raw inputs and ``input_list.txt``."""
    import copy

    from .toolchain import harness

    plan.out.mkdir(parents=True, exist_ok=True)
    compiled = harness.lower_program(copy.deepcopy(graph.program), plan.setup.soc)
    plan.pte("htp").write_bytes(compiled.pte)
    plan.pte("cpu").write_bytes(lower_cpu_only(copy.deepcopy(graph.program)))
    for tensor, path in zip(graph.inputs, plan.input_files):
        tensor.detach().contiguous().numpy().tofile(path)
    names = " ".join(p.name for p in plan.input_files)
    plan.input_list.write_text(names + "\n")
    return Built(
        tuple(graph.inputs),
        graph.reference(),
        harness.delegate_count(compiled.edge),
        compiled.lower_seconds,
    )


# --- running and reading back -------------------------------------------------------------


def parse_latency(log: str, iterations: int) -> float | None:
    """Average milliseconds per execution from the runner's log, None if it printed none.

    The runner logs ``<iterations> inference took <t> ms, avg <a> ms`` per input
    line, then a total over input lines in the same format; the per-line one
    (count equal to ``iterations``) is the per-execution average.
    """
    matches = [(int(n), float(avg)) for n, _, avg in _LATENCY.findall(log)]
    for count, avg in matches:
        if count == iterations:
            return avg
    return matches[0][1] if matches else None


def read_outputs(directory: Path, reference: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``output_0_<j>.raw`` as tensors shaped like the reference (float32 training outputs)."""
    import numpy as np

    outputs = []
    for j, ref in enumerate(reference):
        path = directory / f"output_0_{j}.raw"
        if not path.is_file():
            raise DeviceError(f"the runner wrote no {path.name} in {directory}")
        data = np.fromfile(path, dtype=np.float32)
        if data.size != ref.numel():
            raise DeviceError(f"{path} holds {data.size} floats, expected {ref.numel()}")
        outputs.append(torch.from_numpy(data.copy()).reshape(ref.shape))
    return outputs


def max_abs_error(outputs: Sequence[torch.Tensor], reference: Sequence[torch.Tensor]) -> float:
    return max(float((o - r.float()).abs().max()) for o, r in zip(outputs, reference))


@dataclasses.dataclass
class ProgramRun:
    program: str
    latency_ms: float | None
    max_abs_error: float
    log: str


Runner = Callable[[list[str]], subprocess.CompletedProcess]


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def execute(plan: Plan, reference: Sequence[torch.Tensor], run: Runner = _run) -> list[ProgramRun]:
    """Push, run both programs, pull and compare; DeviceError on the first failing command."""

    def checked(cmd: list[str]) -> str:
        logger.info("$ %s", shlex.join(cmd))
        proc = run(cmd)
        if proc.returncode != 0:
            tail = (proc.stdout or "").strip().splitlines()[-3:]
            raise DeviceError(f"exit {proc.returncode}: {shlex.join(cmd)}: {' | '.join(tail)}")
        return proc.stdout or ""

    for cmd in plan.prepare_commands():
        checked(cmd)
    logs = {p: checked(plan.run_command(p)) for p in PROGRAMS}
    results = []
    for program in PROGRAMS:
        shutil.rmtree(plan.out / f"outputs_{program}", ignore_errors=True)  # no stale outputs
        checked(plan.pull_command(program))
        outputs = read_outputs(plan.out / f"outputs_{program}", reference)
        latency = parse_latency(logs[program], plan.iterations)
        if latency is None:
            logger.warning(
                "%s: the runner logged no timing line (built with the Android log PAL? "
                "see adb logcat)",
                program,
            )
        results.append(
            ProgramRun(program, latency, max_abs_error(outputs, reference), logs[program])
        )
    return results
