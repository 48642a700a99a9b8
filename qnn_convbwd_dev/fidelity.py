"""Gradient fidelity of a training step on the HTP, judged against torch's own fp16.

The HTP computes in fp16, so an fp32 eager reference alone says little: torch
itself computing the same step in float16 is off by tens of percent on some
gradients (docs/numerics.md). ``assess`` compares each output of a joint
forward-backward program (loss and one gradient per trained parameter, in
output-spec order, as ``toolchain.harness.run_pte`` returns them) with the fp32
reference (``models.autograd_reference``), and puts the same numbers for torch's
fp16 step (``fp16_reference``, the *floor*) beside them.

A tensor is within fidelity when

    rel_l2     <= REL_L2_FACTOR * floor.rel_l2 + REL_L2_EPS          and
    1 - cosine <= REL_L2_FACTOR**2 * (1 - floor.cosine) + COSINE_SLACK.

The cosine limit is the relative-L2 limit carried over: for an error e
orthogonal to the reference, 1 - cosine ~= rel_l2**2 / 2, so twice the floor's
relative L2 allows four times its 1 - cosine. A fixed slack on the cosine
(``floor.cosine - 1e-3``) fails a lowering whose errors are fp16's own: measured
on a MobileNet-like bias-only step (numerics_models.bn_training_graph, SM8650),
a bias gradient with rel_l2 0.173 against the floor's 0.164 (1.06x) has cosine
0.98496 against 0.98674.
A tensor the HTP returns with an infinite or NaN element is never within. One
whose fp16 step overflows (torch's float16 autograd returns inf or NaN there:
EfficientNet-B0's fully trained step at 32 px has one) has no floor to match:
its floor counts as the worst possible (relative L2 inf, cosine -1), so a
finite HTP gradient is within, and the table says the floor was not finite.
``REL_L2_EPS`` covers tensors whose floor is ~0 (fp16 happens to be exact, e.g.
a loss or a bias gradient of few terms): 1e-3 is twice fp16's unit roundoff
(2**-11 = 4.9e-4) in relative L2, the error of one rounding to fp16 of every
element, which no fp16 computation can be asked to beat.

The verdict of one sample assumes the step is well conditioned: that an error
of fp16's size in the forward moves each gradient by about as much in every
fp16 computation. ``input_spread`` checks it: fp32 steps whose inputs are moved
by at most one fp16 unit roundoff, each judged like the HTP. A tensor one of
them already fails (``Report.ill_conditioned``) is decided by where ReLU masks
flip, not by the lowering (docs/zoo.md: ShuffleNetV2 and SqueezeNet at 32 px).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics
from collections.abc import Sequence

import torch

from .reference_kernels import fp16_kernels

REL_L2_FACTOR = 2.0
UNIT_ROUNDOFF = 2.0**-11  # fp16
REL_L2_EPS = 1e-3
COSINE_SLACK = 1e-3


@dataclasses.dataclass(frozen=True)
class Metrics:
    """Errors of one tensor against the fp32 reference."""

    max_rel: float  # max|a - b| / max|b|
    rel_l2: float  # ||a - b|| / ||b||
    cosine: float  # <a, b> / (||a|| ||b||); 1 when both are zero
    finite: bool = True  # every element of the actual tensor is finite

    @classmethod
    def of(cls, actual: torch.Tensor, reference: torch.Tensor) -> Metrics:
        a = actual.detach().double().flatten()
        b = reference.detach().double().flatten()
        if a.shape != b.shape:
            raise ValueError(f"shape {tuple(actual.shape)} vs reference {tuple(reference.shape)}")
        if not bool(torch.isfinite(a).all()):
            return cls(max_rel=math.inf, rel_l2=math.inf, cosine=-1.0, finite=False)
        diff = a - b
        return cls(
            max_rel=_ratio(diff.abs().max().item(), b.abs().max().item()),
            rel_l2=_ratio(diff.norm().item(), b.norm().item()),
            cosine=_cosine(a, b),
        )


def _ratio(num: float, den: float) -> float:
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    na, nb = a.norm().item(), b.norm().item()
    if na == 0.0 and nb == 0.0:
        return 1.0
    if na == 0.0 or nb == 0.0:
        return 0.0
    return (a @ b).item() / (na * nb)


@dataclasses.dataclass(frozen=True)
class Row:
    name: str  # "loss" or the parameter's name
    htp: Metrics
    floor: Metrics  # torch's fp16 step

    @property
    def rel_l2_limit(self) -> float:
        return REL_L2_FACTOR * self.floor.rel_l2 + REL_L2_EPS

    @property
    def cosine_limit(self) -> float:
        return 1.0 - (REL_L2_FACTOR**2 * (1.0 - self.floor.cosine) + COSINE_SLACK)

    @property
    def within(self) -> bool:
        return (
            self.htp.finite
            and self.htp.rel_l2 <= self.rel_l2_limit
            and self.htp.cosine >= self.cosine_limit
        )

    def why(self) -> str:
        """What exceeds the limits (empty when within)."""
        if not self.htp.finite:
            return "not finite"
        reasons = []
        if not self.htp.rel_l2 <= self.rel_l2_limit:
            reasons.append(f"rel_l2 {self.htp.rel_l2:.3g} > {self.rel_l2_limit:.3g}")
        if not self.htp.cosine >= self.cosine_limit:
            reasons.append(f"cosine {self.htp.cosine:.6f} < {self.cosine_limit:.6f}")
        return "; ".join(reasons)


@dataclasses.dataclass(frozen=True)
class Report:
    rows: list[Row]

    @property
    def within(self) -> bool:
        return all(r.within for r in self.rows)

    @property
    def offending(self) -> list[str]:
        """``"<tensor>: <reason>"`` for every tensor outside the limits."""
        return [f"{r.name}: {r.why()}" for r in self.rows if not r.within]

    def verdict(self) -> str:
        if self.within:
            return f"within fidelity ({len(self.rows)} tensors)"
        return "not within fidelity: " + ", ".join(self.offending)

    def worst(self) -> Row:
        """The row with the largest relative L2 error on the HTP."""
        return max(self.rows, key=lambda r: r.htp.rel_l2)

    def ill_conditioned(self, spread: Sequence[float]) -> list[str]:
        """Names of the tensors whose ``input_spread`` exceeds their relative-L2 limit.

        ``spread`` is in output order, one value per row. Such a tensor is outside
        the limit in an fp32 step whose input moved by one fp16 rounding: its
        verdict does not tell the lowering from fp16 noise.
        """
        if len(spread) != len(self.rows):
            raise ValueError(f"{len(spread)} spreads for {len(self.rows)} tensors")
        return [r.name for r, s in zip(self.rows, spread) if s > r.rel_l2_limit]

    def to_markdown(self) -> str:
        head = (
            "| tensor | max-abs rel | rel L2 | cosine | fp16 max-abs rel | fp16 rel L2 "
            "| fp16 cosine | within |\n|---|---|---|---|---|---|---|---|"
        )
        lines = [
            f"| {r.name} | {r.htp.max_rel:.3g} | {r.htp.rel_l2:.3g} | {r.htp.cosine:.6f} "
            f"| {r.floor.max_rel:.3g} | {r.floor.rel_l2:.3g} | {r.floor.cosine:.6f} "
            f"| {'yes' if r.within else 'no: ' + r.why()}"
            f"{'' if r.floor.finite else ' (fp16 step not finite)'} |"
            for r in self.rows
        ]
        return "\n".join([head, *lines, "", self.verdict()])


def pooled(reports: Sequence[Report], how: str = "rms") -> Report:
    """One report over several inputs of the same program: each tensor's errors pooled.

    The floor of one input is one draw of torch fp16's error. For a tensor of few
    elements (the loss, a 3-channel adapter's bias) or a bias gradient whose sum
    over positions is the size of its own noise, that draw varies tenfold from
    one input to the next (docs/cost.md: resnet18's adapter.bias, 0.036 to 0.45
    over 11 inputs), so one input's verdict on such a tensor is a coin toss.
    Pooled, per tensor and for the HTP and the floor alike: the root mean square
    of the relative L2 errors, the mean of ``1 - cosine``, the largest max-abs
    relative error; the limits (``Row``) are then applied to the pooled numbers.

    ``how="median"`` takes each number's median over the reports instead (the
    mean of the middle two for an even count): a typical draw rather than the mean square,
    which one flipped ReLU mask in one report can dominate for the HTP and the
    floor alike, so a lowering that is off on most inputs fails it even where
    such a flip lifts the root mean square of the floor.
    """
    if not reports:
        raise ValueError("no reports to pool")
    if how not in ("rms", "median"):
        raise ValueError(f"how must be 'rms' or 'median', got {how!r}")
    names = [r.name for r in reports[0].rows]
    if any([r.name for r in report.rows] != names for report in reports):
        raise ValueError("reports of different programs")

    def pool(metrics: list[Metrics]) -> Metrics:
        if how == "median":
            return Metrics(
                max_rel=statistics.median([m.max_rel for m in metrics]),
                rel_l2=statistics.median([m.rel_l2 for m in metrics]),
                cosine=1.0 - statistics.median([1.0 - m.cosine for m in metrics]),
                finite=all(m.finite for m in metrics),
            )
        return Metrics(
            max_rel=max(m.max_rel for m in metrics),
            rel_l2=math.sqrt(sum(m.rel_l2**2 for m in metrics) / len(metrics)),
            cosine=1.0 - sum(1.0 - m.cosine for m in metrics) / len(metrics),
            finite=all(m.finite for m in metrics),
        )

    rows = []
    for i, name in enumerate(names):
        per_input = [report.rows[i] for report in reports]
        rows.append(Row(name, pool([r.htp for r in per_input]), pool([r.floor for r in per_input])))
    return Report(rows)


def neighbourhood_summary(reports: Sequence[Report]) -> tuple[bool, list[str]]:
    """Whether ``reports`` (the input's first, then its neighbours') are within by the
    rms and the median pooling both, and the lines that say so: the median verdict,
    the input's own, and how many draws are within alone."""
    median = pooled(reports, how="median")
    lines = [
        f"medians: {median.verdict()}",
        f"the input alone: {reports[0].verdict()}",
        f"within alone: {sum(r.within for r in reports)} of {len(reports)}",
    ]
    return pooled(reports).within and median.within, lines


def output_names(joint: torch.export.ExportedProgram) -> list[str]:
    """One name per judged output of a joint program: "loss" or the parameter it is a
    gradient of. A train() graph's buffer updates (running statistics) are not judged."""
    names = []
    for spec in joint.graph_signature.output_specs:
        kind = spec.kind.name
        if kind == "BUFFER_MUTATION":
            continue
        if kind == "LOSS_OUTPUT":
            names.append("loss")
        elif kind == "GRADIENT_TO_PARAMETER":
            names.append(str(spec.target))
        else:
            raise ValueError(f"unexpected output kind {kind}")
    return names


def fp16_reference(
    model: torch.nn.Module,
    inputs: Sequence[torch.Tensor],
    joint: torch.export.ExportedProgram,
    loss_scale: float = 1.0,
) -> list[torch.Tensor]:
    """Torch's own float16 training step (CPU autograd on a float16 copy), as float32.

    The model and the floating-point inputs are copied to float16 (including
    batch-norm statistics and other buffers); the outputs are in the joint
    program's output order, like ``models.autograd_reference``. ``loss_scale``
    seeds the backward with that value and divides the gradients by it in fp32
    (what ``options.loss_scale`` does on the HTP). Torch's own CPU kernels, without
    oneDNN and on one thread (``reference_kernels.fp16_kernels``): the floor is then
    the same on every host and every run.
    """
    half = copy.deepcopy(model).half()
    half_inputs = tuple(
        t.detach().half() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
        for t in inputs
    )
    half.zero_grad(set_to_none=True)
    with fp16_kernels():
        loss = half(*half_inputs)
        loss.backward(torch.full_like(loss, loss_scale))
    params = dict(half.named_parameters())
    out = []
    for name in output_names(joint):
        if name == "loss":
            out.append(loss.detach().float())
        else:
            out.append(params[name].grad.detach().float() / loss_scale)
    return out


def neighbours(inputs: Sequence, count: int, seed: int = 0) -> list[tuple]:
    """``inputs`` and ``count - 1`` copies moved by at most one fp16 rounding.

    Each copy multiplies every floating-point input element by ``1 + u *
    UNIT_ROUNDOFF``, ``u`` uniform on [-1, 1] (seeded); other inputs pass
    unchanged. The steps on these inputs are the same step as far as fp16 can
    tell, so the spread of their errors is fp16's own noise on that step.
    """
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    generator = torch.Generator().manual_seed(seed)
    out = [tuple(inputs)]
    for _ in range(count - 1):
        out.append(
            tuple(
                t.detach()
                * (1 + (torch.rand(t.shape, generator=generator) * 2 - 1) * UNIT_ROUNDOFF)
                if isinstance(t, torch.Tensor) and t.is_floating_point()
                else t
                for t in inputs
            )
        )
    return out


def input_spread(
    model: torch.nn.Module,
    inputs: Sequence[torch.Tensor],
    joint: torch.export.ExportedProgram,
    draws: int = 4,
    seed: int = 0,
) -> list[float]:
    """Per output, the largest relative L2 of ``draws`` perturbed fp32 steps against fp32.

    The draws are ``neighbours(inputs, draws + 1, seed)`` after the first, each
    run with fp32 eager autograd; outputs in the joint program's order, like
    ``models.autograd_reference``.
    """
    from .models import autograd_reference

    reference = autograd_reference(model, tuple(inputs), joint)
    worst = [0.0] * len(reference)
    for moved in neighbours(inputs, draws + 1, seed)[1:]:
        step = autograd_reference(model, moved, joint)
        worst = [max(w, Metrics.of(s, r).rel_l2) for w, s, r in zip(worst, step, reference)]
    return worst


def assess(
    joint: torch.export.ExportedProgram,
    htp: Sequence[torch.Tensor],
    reference: Sequence[torch.Tensor],
    fp16: Sequence[torch.Tensor],
) -> Report:
    """Per-tensor fidelity of ``htp`` (program outputs) against ``reference`` (fp32).

    A program emitted for ExecuTorch's training runtime returns the trainable
    parameters after the joint graph's outputs (``weights_to_outputs_pass``);
    those are left out here.
    """
    names = output_names(joint)
    trainable = sum(1 for name in names if name != "loss")
    if len(htp) == len(names) + trainable:
        htp = list(htp)[: len(names)]
    if not len(names) == len(htp) == len(reference) == len(fp16):
        raise ValueError(
            f"{len(names)} outputs in the program, {len(htp)} from the HTP, "
            f"{len(reference)} in the reference, {len(fp16)} in the fp16 step"
        )
    rows = [
        Row(name, Metrics.of(h, r), Metrics.of(f, r))
        for name, h, r, f in zip(names, htp, reference, fp16)
    ]
    return Report(rows)


def assess_model(
    model: torch.nn.Module,
    inputs: Sequence[torch.Tensor],
    joint: torch.export.ExportedProgram,
    htp: Sequence[torch.Tensor],
    loss_scale: float = 1.0,
) -> Report:
    """``assess`` with both references computed from ``model`` and ``inputs``.

    The floor is torch's fp16 step with the same ``loss_scale`` as the HTP's.
    """
    from .models import autograd_reference

    reference = autograd_reference(model, tuple(inputs), joint)
    return assess(joint, htp, reference, fp16_reference(model, inputs, joint, loss_scale))
