"""The fidelity canary: zoo training steps on the simulator, compared with a record.

A lowering that changes what the HTP computes changes the bits of a training
step's outputs. Each ``Canary`` is a seeded torchvision graph (eval() with
calibrated statistics, or train() with batch statistics), lowered with the
options in effect and stepped once on the x86-64 HTP simulator. ``measure``
returns the step's ``Measurement``: a digest of every output of the program, to
the bit, and each judged tensor's errors (the loss and every gradient: relative
L2 and cosine against torch's fp32 step, and torch's own fp16 step beside it,
``fidelity``).

The record (``RECORD``, JSON, one entry per canary) holds the measurements of the
lowering as it is. ``compare`` lists what no longer matches it:

* a digest other than the recorded one: the HTP computes something else, which a
  change claiming to be bit-identical must not do, and any other change must show
  with a new record (``qnn-convbwd fidelity --canary --record``) and its table;
* a tensor whose relative L2 error grows past ``GROWTH`` times its recorded value,
  whatever the digest: a record is never updated into a worse lowering without the
  comparison saying so.

The simulator is deterministic: the same program on the same inputs gives the same
bits in every process. The references run on torch's pinned kernels
(``reference_kernels``), so the recorded errors are the same numbers on every host.
Lowerings go through ``qnn_convbwd.lower``; with the lowering cache on (``measure``
turns it on in the directory ``CACHE_SUBDIRECTORY`` of the context cache's), a second
measurement of an unchanged plugin reads its lowering back instead of compiling.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

RECORD = Path(__file__).with_name("canary_record.json")
GROWTH = 1.10  # a tensor's relative L2 may grow by 10 % before the canary fails
CACHE_SUBDIRECTORY = "canary"
JUDGED = ("LOSS_OUTPUT", "GRADIENT_TO_PARAMETER")


@dataclasses.dataclass(frozen=True)
class Canary:
    """One seeded zoo training step: torchvision's ``arch`` fine-tuned by ``scheme``
    (``zoo.trainable``'s names) with an MSE loss, in ``mode`` ("eval": statistics
    calibrated by ``zoo.calibrated``; "train": batch statistics, dropout in eval())."""

    name: str
    arch: str
    scheme: str
    mode: str
    soc: str
    batch: int = 2
    size: int = 32
    seed: int = 0
    quick: bool = False  # in the default test tier (its lowering is short)

    def about(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


CANARIES = (
    Canary("mobilenet_v3_small-bias_only-eval", "mobilenet_v3_small", "bias_only", "eval",
           "SM8650", quick=True),
    Canary("resnet18-full-eval", "resnet18", "full", "eval", "SM8850"),
    Canary("mobilenet_v2-bias_only-train", "mobilenet_v2", "bias_only", "train", "SM8650"),
    Canary("efficientnet_b0-bias_only-eval", "efficientnet_b0", "bias_only", "eval", "SM8650"),
)  # fmt: skip


def by_name(name: str) -> Canary:
    for canary in CANARIES:
        if canary.name == name:
            return canary
    raise KeyError(f"no canary {name!r}; the canaries are {[c.name for c in CANARIES]}")


@dataclasses.dataclass(frozen=True)
class TensorErrors:
    """One judged tensor's errors against torch's fp32 step, torch fp16's beside them."""

    rel_l2: float
    cosine: float
    floor_rel_l2: float
    floor_cosine: float
    within: bool  # the fidelity judge's verdict (``fidelity.Row.within``)


@dataclasses.dataclass(frozen=True)
class Measurement:
    digest: str  # sha256 of every program output's bytes, in output order
    outputs: int
    tensors: dict[str, TensorErrors]

    def to_json(self) -> dict[str, Any]:
        return {
            "digest": self.digest,
            "outputs": self.outputs,
            "tensors": {name: dataclasses.asdict(e) for name, e in self.tensors.items()},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Measurement:
        tensors = {name: TensorErrors(**e) for name, e in data["tensors"].items()}
        return cls(data["digest"], data["outputs"], tensors)


def digest(outputs: Sequence[torch.Tensor]) -> str:
    """sha256 over each output's dtype, shape and bytes."""
    h = hashlib.sha256()
    for t in outputs:
        t = t.detach().cpu()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def graph(canary: Canary) -> tuple[torch.nn.Module, tuple, torch.export.ExportedProgram]:
    """The canary's model (returning the loss), its input and its joint graph."""
    from qnn_convbwd import training

    from . import zoo

    net = zoo.calibrated(canary.arch, canary.size, 10, canary.seed)
    if canary.mode == "train":
        net.train()
        for module in net.modules():
            if isinstance(module, torch.nn.modules.dropout._DropoutNd):
                module.eval()  # the program's masks are not torch's
    elif canary.mode != "eval":
        raise ValueError(f"{canary.name}: mode must be 'eval' or 'train', got {canary.mode!r}")
    trained = set(zoo.trainable(net, canary.scheme))
    for name, parameter in net.named_parameters():
        parameter.requires_grad_(name in trained)
    model = zoo.Finetune(net)
    generator = torch.Generator().manual_seed(canary.seed + 1)
    inputs = (
        torch.randn(canary.batch, 3, canary.size, canary.size, generator=generator),
        torch.randn(canary.batch, 10, generator=generator),
    )
    return model, inputs, training.export_joint(model, inputs)


def judged(joint: torch.export.ExportedProgram, outputs: Sequence) -> list[torch.Tensor]:
    """The program's loss and gradients, in the joint graph's order.

    A training program returns the joint graph's outputs, then the trained
    parameters (``to_executorch``); a train() graph's running-statistic updates are
    written back in place, not returned."""
    kinds = [spec.kind.name for spec in joint.graph_signature.output_specs]
    count = sum(kind in JUDGED for kind in kinds)
    trained = kinds.count("GRADIENT_TO_PARAMETER")
    if len(outputs) == count + trained:
        return list(outputs[:count])
    if len(outputs) == len(kinds) + trained:
        return [outputs[i] for i, kind in enumerate(kinds) if kind in JUDGED]
    raise ValueError(
        f"{len(outputs)} program outputs for a joint graph of {len(kinds)} outputs "
        f"({count} judged, {trained} trained parameters)"
    )


def measure(canary: Canary, cache: bool = True) -> Measurement:
    """Lower ``canary``'s graph with the options in effect, step it once on the
    simulator and judge it (``cache``: through the lowering cache)."""
    import qnn_convbwd
    from qnn_convbwd import context_cache
    from qnn_convbwd.toolchain import harness

    from . import fidelity, models

    model, inputs, joint = graph(canary)
    settings: dict[str, Any] = {"context_cache": cache}
    if cache:
        settings["context_cache_dir"] = str(context_cache.default_dir() / CACHE_SUBDIRECTORY)
    with qnn_convbwd.enabled(**settings), _cache_switch(cache):
        compiled = harness.lower_program(joint, canary.soc)
    outputs = [o for o in compiled.run(list(inputs)) if isinstance(o, torch.Tensor)]
    report = fidelity.assess(
        joint,
        judged(joint, outputs),
        models.autograd_reference(copy.deepcopy(model), inputs, joint),
        fidelity.fp16_reference(model, inputs, joint),
    )
    tensors = {
        row.name: TensorErrors(
            row.htp.rel_l2, row.htp.cosine, row.floor.rel_l2, row.floor.cosine, row.within
        )
        for row in report.rows
    }
    return Measurement(digest(outputs), len(outputs), tensors)


@contextlib.contextmanager
def _cache_switch(on: bool) -> Iterator[None]:
    """The caches' environment switch set to ``on`` inside the block (the tests' conftest
    turns it off for the process)."""
    from qnn_convbwd import context_cache

    before = os.environ.get(context_cache.ENV_SWITCH)
    os.environ[context_cache.ENV_SWITCH] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(context_cache.ENV_SWITCH, None)
        else:
            os.environ[context_cache.ENV_SWITCH] = before


def load(path: Path = RECORD) -> dict[str, Measurement]:
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return {name: Measurement.from_json(entry["measurement"]) for name, entry in data.items()}


def save(measurements: dict[str, Measurement], path: Path = RECORD) -> None:
    """Write the record: the canaries' settings and measurements, sorted by name
    (written to a temporary file, then renamed over the old record)."""
    data = {
        name: {"canary": by_name(name).about(), "measurement": m.to_json()}
        for name, m in sorted(measurements.items())
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


def compare(recorded: Measurement | None, measured: Measurement) -> list[str]:
    """What in ``measured`` breaks the record (empty: it matches)."""
    if recorded is None:
        return ["no record: measure it and record it (qnn-convbwd fidelity --canary --record)"]
    problems = []
    if measured.digest != recorded.digest:
        problems.append(
            f"digest {measured.digest[:16]} is not the recorded {recorded.digest[:16]}: the "
            "HTP computes other numbers; if that is intended, record it with the table"
        )
    if set(measured.tensors) != set(recorded.tensors):
        problems.append(
            f"judged tensors {sorted(set(measured.tensors) ^ set(recorded.tensors))[:6]} "
            "are in one of the record and the measurement only"
        )
    for name, now in measured.tensors.items():
        then = recorded.tensors.get(name)
        if then is not None and grew(then.rel_l2, now.rel_l2):
            problems.append(
                f"{name}: relative L2 {now.rel_l2:.4g} > {GROWTH:g} x recorded {then.rel_l2:.4g}"
            )
    return problems


def grew(recorded: float, measured: float) -> bool:
    """Whether an error grew past ``GROWTH`` times its record. An infinite error (a
    gradient zero in fp32, non-zero on the HTP: a train() batch norm's bias before
    another batch norm is zero in exact arithmetic) grew only from a finite record;
    a NaN always did."""
    if math.isnan(measured):
        return True
    if math.isinf(measured):
        return not math.isinf(recorded)
    return measured > GROWTH * recorded


def table(name: str, recorded: Measurement | None, measured: Measurement) -> str:
    """Markdown: each tensor's recorded and measured relative L2, torch fp16's, and
    the ratio; then the digests and the verdict."""
    lines = [
        f"### {name}",
        "",
        "| tensor | recorded rel L2 | measured rel L2 | measured / recorded | fp16 rel L2 "
        "| within fidelity |",
        "|---|---|---|---|---|---|",
    ]
    for tensor, now in measured.tensors.items():
        then = recorded.tensors.get(tensor) if recorded else None
        ratio = now.rel_l2 / then.rel_l2 if then and then.rel_l2 else math.nan
        lines.append(
            f"| {tensor} | {then.rel_l2 if then else math.nan:.4g} | {now.rel_l2:.4g} "
            f"| {ratio:.3f} | {now.floor_rel_l2:.4g} | {'yes' if now.within else 'no'} |"
        )
    problems = compare(recorded, measured)
    outside = sum(not e.within for e in measured.tensors.values())
    lines += [
        "",
        f"digest: measured {measured.digest[:16]}, recorded "
        f"{recorded.digest[:16] if recorded else '-'}",
        f"{outside} of {len(measured.tensors)} tensors outside the fidelity bound",
        "matches the record" if not problems else "does NOT match the record:",
        *[f"- {p}" for p in problems],
    ]
    return "\n".join(lines)
