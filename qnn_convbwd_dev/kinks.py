"""Where a training step's gradients hinge on fp16 rounding: gate inputs next to a kink.

A piecewise-linear gate (ReLU, ReLU6 and Hardtanh, Hardsigmoid, Hardswish) has a
slope that jumps at its kinks. An element whose fp32 input lies closer to a kink
than the forward's fp16 rounding noise can land on the other side in any fp16
computation, torch's or the HTP's; the backward then multiplies that element's
upstream gradient by the other slope. Near an element of a spatial activation
that moves a gradient by little; at a pooled, 1x1-spatial activation (the
squeeze-excitation ``fc1`` of MobileNetV3) one element carries the gradient of a
whole channel, and one flip can move a bias gradient by tens of percent:
a step that is ill-conditioned whatever computes it (docs/zoo.md, 96 px).

``find`` runs the model once in fp32 and once in fp16 (torch's own kernels, as
the fidelity floor), hooks every gate module, and returns

* per gate call, how many elements lie within ``within`` times the fp16 noise
  of that gate's input (its relative rms error) of a kink, and how many torch's
  fp16 forward put on the other side (``GateSummary``);
* for those elements (the ``limit`` with the largest gradient jump ``slope
  jump x |upstream gradient|``), the exact first-order change of every trained
  parameter's gradient that flipping the element alone makes
  (``Flip.impact``: its L2 norm over the gradient's, the same measure as the
  fidelity report's relative L2), beside torch fp16's own relative L2 on
  that tensor (``Flip.floor``).

A flip whose impact exceeds ``fidelity.REL_L2_FACTOR`` times the floor puts the
tensor outside the fidelity bound by itself, whenever one side flips it and the
other does not. Only gate *modules* are seen (a ``torch.relu`` call in a
``forward`` is not); torchvision's classifiers use modules throughout.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from .reference_kernels import fp16_kernels, pinned


def kinks_of(module: nn.Module) -> tuple[tuple[float, float], ...]:
    """``(kink, slope jump)`` of a gate module, ``()`` for any other module."""
    if isinstance(module, nn.ReLU):
        return ((0.0, 1.0),)
    if isinstance(module, nn.Hardtanh):  # ReLU6 too
        return ((float(module.min_val), 1.0), (float(module.max_val), 1.0))
    if isinstance(module, nn.Hardsigmoid):  # relu6(x + 3) / 6
        return ((-3.0, 1 / 6), (3.0, 1 / 6))
    if isinstance(module, nn.Hardswish):  # x * relu6(x + 3) / 6: slope 0 | (2x + 3) / 6 | 1
        return ((-3.0, 0.5), (3.0, 0.5))
    return ()


@dataclasses.dataclass(frozen=True)
class GateSummary:
    """One call of a gate module: its input's fp16 noise and the elements at a kink."""

    gate: str  # module name, "#k" for its k-th call in the forward (k >= 1)
    elements: int
    noise: float  # rms(fp16 input - fp32 input) / rms(fp32 input)
    near: int  # elements within ``within`` x noise (of the rms) of a kink
    flipped_fp16: int  # elements torch's fp16 forward puts on the other side of a kink


@dataclasses.dataclass(frozen=True)
class Flip:
    """One gate-input element next to a kink and what flipping it alone does."""

    gate: str
    index: tuple[int, ...]  # into the gate's input
    kink: float
    margin: float  # (fp32 input - kink) / rms(fp32 input), signed
    noise: float  # the gate's GateSummary.noise
    flipped_fp16: bool
    jump: float  # slope jump x |upstream gradient| at the element
    tensor: str  # the trained parameter whose gradient the flip moves most, relatively
    impact: float  # ||change of its gradient|| / ||its gradient||
    floor: float  # torch fp16's relative L2 on that gradient
    # the same relative change for every trained parameter the flip reaches
    impacts: Mapping[str, float] = dataclasses.field(default_factory=dict, compare=False)

    @property
    def decisive(self) -> bool:
        """Whether this flip alone moves ``tensor`` past the fidelity bound's 2x the floor."""
        from .fidelity import REL_L2_EPS, REL_L2_FACTOR

        return self.impact > REL_L2_FACTOR * self.floor + REL_L2_EPS

    @property
    def against_bound(self) -> float:
        """``impact`` over the bound's relative L2 limit on ``tensor`` (> 1: decisive)."""
        from .fidelity import REL_L2_EPS, REL_L2_FACTOR

        if self.floor != self.floor:  # nan: no fp16 gradient to bound it
            return 0.0
        return self.impact / (REL_L2_FACTOR * self.floor + REL_L2_EPS)


@dataclasses.dataclass
class _Call:
    gate: str
    kinks: tuple[tuple[float, float], ...]
    x: torch.Tensor  # fp32 input, in the autograd graph
    y: torch.Tensor  # fp32 output
    x16: torch.Tensor | None = None  # fp16 input, as float32


def not_in_place(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose modules do not overwrite their input.

    An in-place gate overwrites the pre-activation this module needs to keep.
    """
    probe = copy.deepcopy(model)
    for module in probe.modules():
        if getattr(module, "inplace", False):
            module.inplace = False
    return probe


def hooked_forward(model: nn.Module, inputs: Sequence, record) -> torch.Tensor:
    """``model(*inputs)``, calling ``record(gate call, kinks, input, output)`` at every
    gate module call (``"name#k"`` for its k-th call), in call order."""
    counts: dict[str, int] = {}
    handles = []
    for name, module in model.named_modules():
        kinks = kinks_of(module)
        if not kinks:
            continue

        def hook(mod, args, out, name=name, kinks=kinks):
            counts[name] = counts.get(name, 0) + 1
            record(f"{name}#{counts[name]}", kinks, args[0], out)

        handles.append(module.register_forward_hook(hook))
    try:
        return model(*inputs)
    finally:
        for handle in handles:
            handle.remove()


def _rms(t: torch.Tensor) -> float:
    return float(t.double().pow(2).mean().sqrt())


def find(
    model: nn.Module,
    inputs: Sequence,
    top: int | None = 20,
    within: float = 3.0,
    limit: int = 1000,
) -> tuple[list[GateSummary], list[Flip]]:
    """The gates of ``model``'s training step (``model(*inputs)`` returns the loss) at a kink.

    Returns one ``GateSummary`` per gate call, in forward order, and ``top``
    flips: of the elements within ``within`` x noise of a kink or flipped by
    torch fp16, the ``limit`` with the largest gradient jump get their impact
    computed (one backward each), and those nearest the fidelity bound on the
    tensor they move (``Flip.against_bound``) come first (``top=None``: all of
    them). The model is copied; the trained parameters are those that require
    grad.
    """
    probe = not_in_place(model)
    trained = {n: p for n, p in probe.named_parameters() if p.requires_grad}
    if not trained:
        raise ValueError("no parameter of the model requires grad: nothing is trained")
    calls: list[_Call] = []

    def keep(gate, kinks, x, y):
        if y.requires_grad:
            y.retain_grad()
        calls.append(_Call(gate, kinks, x, y))

    with pinned():
        loss = hooked_forward(probe, inputs, keep)
        loss.backward(retain_graph=True)
    grads = {n: p.grad.detach().clone() for n, p in trained.items()}

    half = copy.deepcopy(probe).half()
    half.zero_grad(set_to_none=True)
    half_inputs = [
        t.detach().half() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
        for t in inputs
    ]
    seen = iter(calls)

    def compare(gate, kinks, x, y):
        call = next(seen)
        if call.gate != gate:
            raise RuntimeError(f"the fp16 forward called {gate} where fp32 called {call.gate}")
        call.x16 = x.detach().float()

    with fp16_kernels():
        loss16 = hooked_forward(half, half_inputs, compare)
        loss16.backward()
    floors = {}
    for name, parameter in half.named_parameters():
        if name in grads and parameter.grad is not None:
            reference = grads[name]
            floors[name] = _rms(parameter.grad.float() - reference) / max(_rms(reference), 1e-30)

    summaries, candidates = [], []
    for call in calls:
        if not call.x.requires_grad:
            continue  # nothing trained lies before this gate: no flip moves a gradient
        x = call.x.detach()
        scale = max(_rms(x), 1e-30)
        noise = _rms(call.x16 - x) / scale
        upstream = call.y.grad if call.y.grad is not None else torch.zeros_like(x)
        near_mask = torch.zeros_like(x, dtype=torch.bool)
        flip_mask = torch.zeros_like(x, dtype=torch.bool)
        for kink, slope in call.kinks:
            offset = x - kink
            near = offset.abs() <= within * noise * scale
            flipped = torch.sign(offset) * torch.sign(call.x16 - kink) < 0
            near_mask |= near
            flip_mask |= flipped
            for flat in torch.nonzero((near | flipped).flatten()).flatten().tolist():
                jump = slope * float(upstream.flatten()[flat].abs())
                margin = float(offset.flatten()[flat]) / scale
                site = (call, flat, kink, margin, noise, bool(flipped.flatten()[flat]))
                candidates.append((jump, site))
        summaries.append(
            GateSummary(call.gate, x.numel(), noise, int(near_mask.sum()), int(flip_mask.sum()))
        )

    # The largest jumps first; the impact of each (one backward from its gate) decides
    # the order returned, relative to the bound on the tensor it moves most.
    candidates.sort(key=lambda c: -c[0])
    flips = [_flip(site, jump, trained, grads, floors) for jump, site in candidates[:limit]]
    flips.sort(key=lambda f: -f.against_bound)
    return summaries, flips[:top]


def _flip(site, jump, trained, grads, floors) -> Flip:
    """The first-order change of every trained gradient when one element of a gate's
    input crosses a kink: the backward, from the gate's input, of a one-hot
    cotangent the size of the slope jump times the upstream gradient."""
    call, flat, kink, margin, noise, flipped = site
    names = list(trained)
    cotangent = torch.zeros_like(call.x).flatten()
    cotangent[flat] = jump
    changes = torch.autograd.grad(
        call.x,
        [trained[n] for n in names],
        grad_outputs=cotangent.view_as(call.x),
        retain_graph=True,
        allow_unused=True,
    )
    impacts = {
        name: _rms(change) / max(_rms(grads[name]), 1e-30)
        for name, change in zip(names, changes)
        if change is not None
    }
    best_name = max(impacts, key=impacts.get, default=names[0])
    best = impacts.get(best_name, 0.0)
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), call.x.shape))
    return Flip(
        call.gate,
        index,
        kink,
        margin,
        noise,
        flipped,
        jump,
        best_name,
        best,
        floors.get(best_name, float("nan")),
        impacts,
    )


@dataclasses.dataclass(frozen=True)
class Cause:
    """Why one tensor is outside a fidelity report's bound, as far as single flips tell."""

    tensor: str
    limit: float  # the report's relative-L2 limit on it
    reason: str  # what the report says exceeds its limits (``fidelity.Row.why``)
    flips: tuple[Flip, ...]  # each alone moves it past ``limit``, largest first
    largest: Flip | None  # the flip that moves it most, decisive or not

    @property
    def explained(self) -> bool:
        return bool(self.flips)

    def describe(self) -> str:
        head = f"{self.tensor} ({self.reason}): "
        if self.flips:
            shown = "; ".join(_site(f, self.tensor) for f in self.flips[:3])
            more = f" (+{len(self.flips) - 3} more)" if len(self.flips) > 3 else ""
            return head + f"{len(self.flips)} gate flip(s) alone put it outside: {shown}{more}"
        if self.largest is None:
            return head + "no gate flip moves it to first order: not a kink flip"
        largest = _site(self.largest, self.tensor)
        return head + f"no single gate flip puts it outside; the largest, {largest}"


def _site(flip: Flip, tensor: str) -> str:
    return (
        f"{flip.gate} {list(flip.index)} (kink {flip.kink:g}, margin {flip.margin:+.1e}, "
        f"noise {flip.noise:.1e}) moves it by {flip.impacts.get(tensor, 0.0):.3g}"
    )


def explain(report, flips: Sequence[Flip]) -> list[Cause]:
    """A ``Cause`` for every tensor ``report`` (a ``fidelity.Report``) puts outside the bound.

    ``flips`` should be all the flips ``find`` computed (``top=None``) for the
    same step and input. A tensor is explained when one flip alone moves its
    gradient by more than the report's limit on it: the HTP and torch fp16 then
    differ by that much whenever one of them crosses the kink and the other
    does not. The loss moves only to second order.
    """
    causes = []
    for row in report.rows:
        if row.within:
            continue
        reach = sorted(
            (f for f in flips if row.name in f.impacts),
            key=lambda f: -f.impacts[row.name],
        )
        decisive = tuple(f for f in reach if f.impacts[row.name] > row.rel_l2_limit)
        causes.append(
            Cause(
                row.name,
                row.rel_l2_limit,
                row.why(),
                decisive,
                reach[0] if reach else None,
            )
        )
    return causes


def to_markdown(summaries: Sequence[GateSummary], flips: Sequence[Flip]) -> str:
    """The flips as a markdown table, then the gates with an element near a kink."""
    lines = [
        "| gate | element | kink | margin / rms | fp16 noise / rms | torch fp16 flips it "
        "| moves most | by (rel L2) | its floor | alone outside |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for f in flips:
        lines.append(
            f"| {f.gate} | {list(f.index)} | {f.kink:g} | {f.margin:+.2e} | {f.noise:.2e} | "
            f"{'yes' if f.flipped_fp16 else 'no'} | {f.tensor} | {f.impact:.3g} | "
            f"{f.floor:.3g} | {'yes' if f.decisive else 'no'} |"
        )
    lines += ["", "| gate | elements | fp16 noise / rms | near a kink | torch fp16 flips |"]
    lines.append("|---|---|---|---|---|")
    for s in summaries:
        if s.near or s.flipped_fp16:
            lines.append(
                f"| {s.gate} | {s.elements} | {s.noise:.2e} | {s.near} | {s.flipped_fp16} |"
            )
    return "\n".join(lines)
