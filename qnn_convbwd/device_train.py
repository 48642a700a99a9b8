"""Train a ``qnn-convbwd finetune`` run's ``train.pte`` on an Android device over adb.

``train.pte`` (written by ``qnn-convbwd finetune --out RUN``) applies its optimizer
itself: one call of its ``forward([x, y])`` is one training step (forward, backward,
update) that returns the loss and keeps the parameters, running statistics and
optimizer state in the program's own buffers. So the device needs a runner that
calls ``forward`` once per batch on one loaded method and, at the end, writes the
buffers out. executorch 1.5.1 ships no such runner for Android:
``qnn_executor_runner`` loads the method once and executes it ``--iteration`` times
per input line (a training step each) but writes only the outputs (the losses), so
the trained weights end with its process; the training examples' C++ runners
(``extension/training/examples``) apply executorch's SGD from a program's gradient
outputs, which this program has none of, to their own data formats. The script
therefore takes ``--runner``, a binary with this command-line contract (``RUNNER``):

    RUNNER --model_path train.pte [--data_path train.ptd]
           --input_list_path input_list.txt --dump_list_path dump_list.txt
           --output_folder_path DIR

* ``input_list.txt``: one line per training step, the step's input files separated
  by spaces, in ``forward``'s input order (the images, then the labels); each file
  is the tensor's bytes, C-contiguous, in the dtype and shape the method's metadata
  gives (float32 ``(batch, 3, size, size)``, int64 ``(batch,)``). The runner calls
  ``forward`` once per line, in order, on the same loaded method.
* It writes ``DIR/output_<k>_0.raw``, step ``k``'s loss (the first output: one
  float32), as ``qnn_executor_runner`` names its outputs.
* After the last step, for each name in ``dump_list.txt`` (one per line), it writes
  ``DIR/<name>.raw``: the bytes of ``Method::get_attribute(name)``, the program's own
  tensor of that buffer.
* It exits 0 when all of that is written, non-zero otherwise.

The host side (``plan``, ``execute``, ``read_results``) writes the batches, pushes
them with the program, runs the runner, pulls ``DIR`` back and turns it into the
trained ``state_dict`` (the run's ``model.pt`` with the trained tensors replaced),
every buffer by program name (``program_state.pt``, what ``TrainingProgram.emit``
and ``load_program_state`` take) and the losses.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shlex
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .device import DeviceError, Runner, _run
from .passes import filter_storage
from .training import (
    PLUGIN_BUFFER_PREFIX,
    BufferSpec,
    program_buffers,
    shared_prefix,
    stored_layouts,
)

logger = logging.getLogger(__name__)

RUN_FILES = ("train.pte", "report.json", "model.pt")  # what a finetune run must hold
INPUT_LIST, DUMP_LIST, OUTPUTS = "input_list.txt", "dump_list.txt", "outputs"


class ArtifactError(ValueError):
    """A run folder or data file that cannot be trained from; the message names it."""


@dataclasses.dataclass
class Run:
    """A finetune run's artifacts: the program, its buffers and the trained model."""

    folder: Path
    pte: Path
    ptd: Path | None
    report: dict
    model: dict[str, torch.Tensor]  # model.pt: the eager module's state_dict
    buffers: dict[str, BufferSpec]  # every tensor the program keeps, by program name
    # Trained weights the program stores permuted (``training.stored_layouts``).
    stored: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    @property
    def delegates(self) -> int:
        return int(self.report.get("delegates", {}).get("train", 0))

    @property
    def prefix(self) -> str:
        """What the program's names carry in front of the eager module's (``net.``)."""
        return shared_prefix([n for n in self.buffers if not n.startswith(PLUGIN_BUFFER_PREFIX)])

    def eager_name(self, name: str) -> str | None:
        """The ``state_dict`` name of a program buffer, None for the plugin's own
        (optimizer state, counters) and buffers the state_dict does not hold."""
        if name.startswith(PLUGIN_BUFFER_PREFIX):
            return None
        eager = name[len(self.prefix) :] if name.startswith(self.prefix) else name
        return eager if eager in self.model else None


def load_run(folder: str | Path) -> Run:
    """Read and check a ``qnn-convbwd finetune --out`` folder; ``ArtifactError`` names the
    first file missing or unreadable."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ArtifactError(f"--run {folder}: not a folder")
    for name in RUN_FILES:
        if not (folder / name).is_file():
            raise ArtifactError(f"--run {folder}: no {name} there (a finetune --out folder)")
    try:
        report = json.loads((folder / "report.json").read_text())
    except (OSError, ValueError) as err:
        raise ArtifactError(f"{folder / 'report.json'}: not readable JSON ({err})") from None
    for key in ("program_optimizer", "normalize", "classes", "input", "args"):
        if key not in report:
            raise ArtifactError(
                f"{folder / 'report.json'}: no {key!r}; train.pte of this run does not apply "
                "its own optimizer (written by another version of qnn-convbwd finetune)"
            )
    try:
        model = torch.load(folder / "model.pt", map_location="cpu", weights_only=True)
    except Exception as err:  # truncated or not a torch file
        raise ArtifactError(f"{folder / 'model.pt'}: not readable ({type(err).__name__})") from None
    pte = folder / "train.pte"
    try:
        buffers = program_buffers(pte.read_bytes())
        stored = stored_layouts(pte.read_bytes())
    except Exception as err:  # not a program executorch can read
        raise ArtifactError(f"{pte}: not an executorch program ({type(err).__name__})") from None
    ptd = folder / "train.ptd"
    run = Run(folder, pte, ptd if ptd.is_file() else None, report, model, buffers, stored)
    trained = report["program_optimizer"].get("parameters", [])
    missing = [n for n in trained if n not in buffers or run.eager_name(n) is None]
    if missing:
        raise ArtifactError(
            f"{pte}: the trained parameters {missing} are not buffers of the program or not "
            "in model.pt (train.pte and model.pt of different runs?)"
        )
    return run


def batches(
    run: Run, data: str | Path, steps: int | None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` batches of the run's batch size from ``data`` (a folder or tensor file as
    ``finetune --data`` reads it, with the run's classes and normalisation), in the
    data's order, the samples past the last full batch left out, from the start again
    when ``steps`` needs more (default: one pass)."""
    from . import finetune_data

    size = int(run.report["input"][-1])
    batch = int(run.report["args"]["batch"])
    dataset = finetune_data.load(data, size, classes=run.report["classes"])
    normalize = finetune_data.Normalize(
        run.report["normalize"]["mean"], run.report["normalize"]["std"]
    )
    x, y = normalize(dataset.x).contiguous(), dataset.y.to(torch.int64)
    full = len(y) // batch
    if full == 0:
        raise ArtifactError(f"{data}: {len(y)} samples, fewer than one batch of {batch}")
    steps = full if steps is None else steps
    if steps <= 0:
        raise ArtifactError(f"--steps {steps}: must be positive")
    picked = [(k % full) * batch for k in range(steps)]
    return [(x[i : i + batch], y[i : i + batch]) for i in picked]


@dataclasses.dataclass
class Plan:
    """Every file and adb command of one training run on the device."""

    run: Run
    runner: Path
    out: Path  # host folder: batches, lists, pulled outputs, results
    steps: int
    workspace: str
    adb_path: str = "adb"
    serial: str | None = None
    adb_host: str | None = None
    libraries: tuple[Path, ...] = ()  # QNN libraries and the backend library to push

    @property
    def batch_files(self) -> list[tuple[Path, Path]]:
        return [(self.out / f"x_{k}.raw", self.out / f"y_{k}.raw") for k in range(self.steps)]

    def adb(self, *args: str) -> list[str]:
        cmd = [self.adb_path]
        if self.adb_host:
            cmd += ["-H", self.adb_host]
        if self.serial:
            cmd += ["-s", self.serial]
        return [*cmd, *args]

    def push_files(self) -> list[Path]:
        program = [self.run.pte, *([self.run.ptd] if self.run.ptd else [])]
        data = [f for pair in self.batch_files for f in pair]
        lists = [self.out / INPUT_LIST, self.out / DUMP_LIST]
        return [self.runner, *self.libraries, *program, *data, *lists]

    def runner_shell(self) -> str:
        runner = self.runner.name
        args = [
            "--model_path",
            self.run.pte.name,
            *(["--data_path", self.run.ptd.name] if self.run.ptd else []),
            "--input_list_path",
            INPUT_LIST,
            "--dump_list_path",
            DUMP_LIST,
            "--output_folder_path",
            f"{self.workspace}/{OUTPUTS}",
        ]
        return (
            f"cd {self.workspace} && chmod +x {runner} && export LD_LIBRARY_PATH=. && "
            f"export ADSP_LIBRARY_PATH=. && ./{runner} {shlex.join(args)}"
        )

    def commands(self) -> list[list[str]]:
        prepare = self.adb(
            "shell", f"rm -rf {self.workspace} && mkdir -p {self.workspace}/{OUTPUTS}"
        )
        pushes = [self.adb("push", str(f), f"{self.workspace}/{f.name}") for f in self.push_files()]
        run = self.adb("shell", self.runner_shell())
        pull = self.adb("pull", f"{self.workspace}/{OUTPUTS}", str(self.out))
        return [prepare, *pushes, run, pull]


def write_inputs(plan: Plan, data: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The batches as raw files, ``input_list.txt`` (one line per step) and
    ``dump_list.txt`` (every buffer of the program)."""
    plan.out.mkdir(parents=True, exist_ok=True)
    lines = []
    for (x, y), (x_file, y_file) in zip(data, plan.batch_files, strict=True):
        x.to(torch.float32).contiguous().numpy().tofile(x_file)
        y.to(torch.int64).contiguous().numpy().tofile(y_file)
        lines.append(f"{x_file.name} {y_file.name}")
    (plan.out / INPUT_LIST).write_text("\n".join(lines) + "\n")
    (plan.out / DUMP_LIST).write_text("\n".join(plan.run.buffers) + "\n")


def execute(plan: Plan, run: Runner = _run) -> str:
    """Push, train, pull; returns the runner's log. ``DeviceError`` on the first failing
    command, naming it and the last lines it printed."""
    log = ""
    shutil.rmtree(plan.out / OUTPUTS, ignore_errors=True)  # no stale outputs
    for cmd in plan.commands():
        logger.info("$ %s", shlex.join(cmd))
        proc = run(cmd)
        if proc.returncode != 0:
            tail = (proc.stdout or "").strip().splitlines()[-3:]
            raise DeviceError(f"exit {proc.returncode}: {shlex.join(cmd)}: {' | '.join(tail)}")
        if cmd[-1] == plan.runner_shell():
            log = proc.stdout or ""
    return log


@dataclasses.dataclass
class Results:
    losses: list[float]
    program_state: dict[str, torch.Tensor]  # every buffer, by program name
    state_dict: dict[str, torch.Tensor]  # model.pt with the trained tensors replaced


def _read_raw(path: Path, spec: BufferSpec) -> torch.Tensor:
    if not path.is_file():
        raise DeviceError(f"the runner wrote no {path.name} (looked in {path.parent})")
    data = path.read_bytes()
    if len(data) != spec.nbytes:
        raise DeviceError(
            f"{path}: {len(data)} bytes, expected {spec.nbytes} ({spec.dtype} {list(spec.shape)})"
        )
    return torch.frombuffer(bytearray(data), dtype=spec.dtype).reshape(spec.shape).clone()


def read_results(plan: Plan) -> Results:
    """The pulled outputs as losses, program state and ``state_dict``; ``DeviceError``
    names the first file missing or of the wrong size."""
    folder = plan.out / OUTPUTS
    loss = BufferSpec(torch.float32, (1,))
    losses = [float(_read_raw(folder / f"output_{k}_0.raw", loss)) for k in range(plan.steps)]
    state = {
        name: _read_raw(folder / f"{name}.raw", spec) for name, spec in plan.run.buffers.items()
    }
    model = {k: v.clone() for k, v in plan.run.model.items()}
    for name, value in state.items():
        eager = plan.run.eager_name(name)
        if eager is not None:
            value = filter_storage.torch_view(value, plan.run.stored.get(name))
            if tuple(model[eager].shape) != tuple(value.shape):
                raise DeviceError(
                    f"{name}: {list(value.shape)} from the device, {list(model[eager].shape)} "
                    "in model.pt"
                )
            model[eager] = value.to(model[eager].dtype).contiguous()
    return Results(losses, state, model)


def save_results(results: Results, out: Path, extra: dict[str, Any]) -> list[Path]:
    """``model.pt``, ``program_state.pt`` and ``losses.json`` under ``out``, each written
    atomically."""
    from .finetune import save_atomic, write_atomic

    written = [out / "model.pt", out / "program_state.pt", out / "losses.json"]
    save_atomic(written[0], results.state_dict)
    save_atomic(written[1], results.program_state)
    text = json.dumps({"losses": results.losses, **extra}, indent=1) + "\n"
    write_atomic(written[2], text.encode())
    return written
