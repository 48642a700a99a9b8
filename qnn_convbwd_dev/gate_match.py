"""Gate-matched fidelity: the HTP's arithmetic judged apart from its gate decisions.

A gate's backward (ReLU, ReLU6 and Hardtanh, Hardsigmoid, Hardswish) picks each
element's slope by comparing a forward tensor with the kink: the gate's input, or
for ReLU its output. Any fp16 forward rounds a few elements next to a kink to the
other side, torch's and the HTP's alike, but not the same elements. Where a few
elements carry a whole channel's gradient (the squeeze-excitation ``fc1`` of
MobileNetV3, at 1x1 spatial), those decisions are most of the error, and the
fidelity bound then compares two draws of which elements flipped
(``qnn_convbwd_dev.kinks``; docs/zoo.md).

This module takes each side's own decisions out of the comparison:

* ``with_gate_outputs`` appends every gate's compared tensor to a joint
  program's outputs. Lowered like the joint graph, the program returns those
  tensors as the HTP computed them; ``GatedProgram.split`` separates them from
  the joint graph's own outputs. On MobileNetV3-Small fully trained at 32 px the
  joint outputs were bit-identical to the plain program's in all 2,431
  tensor-draws (SM8650 and SM8850). ``zoo``'s sweep checks this again on every graph
  it is used on.
* ``matched_step`` is torch's fp32 training step with every gate's side of the
  kink taken from given tensors. The slopes' values (Hardswish's ``x / 3 + 0.5``)
  and everything else stay fp32.
* ``assess`` is a ``fidelity.Report`` whose rows compare the HTP with fp32 on the
  HTP's gate decisions, and torch fp16 with fp32 on torch fp16's decisions. Each
  side's rounding error is then measured with its own gates, under the same bound
  (``fidelity.Row.within``).
* ``flipped`` counts, per gate call, the elements whose slope differs from fp32's.

Only gate *modules* are matched, as in ``qnn_convbwd_dev.kinks``. Max-pool argmax choices are
not matched.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from . import fidelity, kinks
from .reference_kernels import fp16_kernels, pinned

# The comparisons a gate's backward makes, in torch's decompositions: ReLU's
# threshold_backward compares its output (``le``), Hardtanh's its input (``le``,
# ``ge``), Hardsigmoid's and Hardswish's their input (``gt``/``lt``, ``lt``/``le``).
_COMPARISONS = ("aten.lt.Scalar", "aten.le.Scalar", "aten.gt.Scalar", "aten.ge.Scalar")


def slope(module: nn.Module, x: torch.Tensor, side: torch.Tensor) -> torch.Tensor:
    """The backward slope of gate ``module`` at fp32 input ``x``, each element on the
    side of its kink that ``side`` is on (torch's conventions at a kink itself).

    ``side`` is the tensor the gate's backward compares: its input, or for ReLU
    its input or output (both are positive exactly where the slope is 1).
    """
    side = side.to(x.dtype).reshape(x.shape)
    if isinstance(module, nn.ReLU):
        return (side > 0).to(x.dtype)
    if isinstance(module, nn.Hardtanh):  # ReLU6 too
        return ((side > module.min_val) & (side < module.max_val)).to(x.dtype)
    if isinstance(module, nn.Hardsigmoid):
        return ((side > -3) & (side < 3)).to(x.dtype) / 6
    if isinstance(module, nn.Hardswish):
        middle = x / 3 + 0.5
        return torch.where(side < -3, 0.0, torch.where(side <= 3, middle, 1.0)).to(x.dtype)
    raise TypeError(f"{type(module).__name__} is not a gate kinks.kinks_of knows")


class _GivenSlope(torch.autograd.Function):
    """Identity on the gate's fp32 output; the backward multiplies by a given slope."""

    @staticmethod
    def forward(ctx, x, y, slopes):
        ctx.save_for_backward(slopes)
        return y.clone()

    @staticmethod
    def backward(ctx, grad):
        (slopes,) = ctx.saved_tensors
        return grad * slopes, None, None


def _gate_calls(model: nn.Module, inputs: Sequence) -> list[tuple[str, torch.Size]]:
    """``(gate call, input shape)`` of every gate module call of ``model(*inputs)``."""
    calls: list[tuple[str, torch.Size]] = []
    with torch.no_grad(), pinned():
        kinks.hooked_forward(
            kinks.not_in_place(model), inputs, lambda g, k, x, y: calls.append((g, x.shape))
        )
    return calls


def _unaliased(node: torch.fx.Node) -> torch.fx.Node:
    """The tensor an ``aten.alias`` chain (ReLU's saved output) names."""
    while node.op == "call_function" and str(node.target) == "aten.alias.default":
        node = node.args[0]
    return node


@dataclasses.dataclass(frozen=True)
class GatedProgram:
    """A joint program with its gate tensors appended as user outputs (``at`` onwards)."""

    program: torch.export.ExportedProgram
    at: int  # index of the first gate tensor among the program's outputs
    gates: tuple[str, ...]  # the gate call each appended output belongs to

    def split(self, outputs: Sequence[torch.Tensor]) -> tuple[list, list]:
        """``(the joint program's own outputs, the gate tensors)`` of one run.

        The own outputs keep whatever follows them (a training program's trained
        parameters), in order.
        """
        outputs = list(outputs)
        end = self.at + len(self.gates)
        if len(outputs) < end:
            raise ValueError(f"{len(outputs)} outputs: fewer than the {end} of the gated program")
        return outputs[: self.at] + outputs[end:], outputs[self.at : end]


def with_gate_outputs(
    joint: torch.export.ExportedProgram, model: nn.Module, inputs: Sequence
) -> GatedProgram:
    """``joint`` (from ``_export_forward_backward`` of ``model`` on ``inputs``) that
    also returns, after its user outputs, the tensor each gate's backward compares.

    Those tensors are found as the forward tensors a scalar comparison in the graph
    reads, in graph order; there must be exactly one per gate module call of
    ``model``, of its input's shape, in call order, or this raises naming the
    first mismatch (a gate written as a function, not a module, is not seen).
    """
    from torch.export.graph_signature import OutputKind, OutputSpec, TensorArgument

    program = copy.deepcopy(joint)
    graph = program.graph_module.graph
    position = {node: i for i, node in enumerate(graph.nodes)}
    compared = {
        _unaliased(node.args[0])
        for node in graph.nodes
        if node.op == "call_function" and str(node.target) in _COMPARISONS
    }
    found = sorted(compared, key=position.__getitem__)
    calls = _gate_calls(model, inputs)
    if len(found) != len(calls):
        raise ValueError(
            f"{len(found)} tensors compared with a scalar in the joint graph, "
            f"{len(calls)} gate module calls in the model: cannot pair them"
        )
    for node, (gate, shape) in zip(found, calls):
        if tuple(node.meta["val"].shape) != tuple(shape):
            raise ValueError(
                f"gate {gate}: input {tuple(shape)}, but the joint graph's tensor "
                f"{node.name} is {tuple(node.meta['val'].shape)}"
            )
    specs = program.graph_signature.output_specs
    user = (OutputKind.BUFFER_MUTATION, OutputKind.USER_OUTPUT, OutputKind.LOSS_OUTPUT)
    at = 1 + max((i for i, spec in enumerate(specs) if spec.kind in user), default=-1)
    output = next(node for node in graph.nodes if node.op == "output")
    own = tuple(output.args[0])
    output.args = (own[:at] + tuple(found) + own[at:],)
    for offset, node in enumerate(found):
        arg = TensorArgument(name=node.name)
        specs.insert(at + offset, OutputSpec(kind=OutputKind.USER_OUTPUT, arg=arg, target=None))
    program.graph_module.recompile()
    return GatedProgram(program, at, tuple(gate for gate, _ in calls))


def matched_step(
    model: nn.Module,
    inputs: Sequence,
    joint: torch.export.ExportedProgram,
    sides: Sequence[torch.Tensor],
) -> list[torch.Tensor]:
    """Torch's fp32 step of ``model`` (returns the loss) with every gate element on the
    side of its kink that ``sides`` (one tensor per gate call, in call order) puts
    it; outputs in ``joint``'s order, like ``models.autograd_reference``."""
    probe = kinks.not_in_place(model)
    trained = {name: p for name, p in probe.named_parameters() if p.requires_grad}
    given = iter(sides)
    used = []

    def hook(module, args, out, name):
        side = next(given, None)
        if side is None:
            raise ValueError(f"gate {name}: {len(used)} side tensors given, more gate calls")
        x = args[0]
        if side.numel() != x.numel():
            raise ValueError(
                f"gate {name}: side tensor of {side.numel()} elements, input {x.shape}"
            )
        used.append(name)
        return _GivenSlope.apply(x, out, slope(module, x.detach(), side))

    handles = [
        module.register_forward_hook(lambda m, a, o, name=name: hook(m, a, o, name))
        for name, module in probe.named_modules()
        if kinks.kinks_of(module)
    ]
    try:
        with pinned():
            loss = probe(*inputs)
            loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    if next(given, None) is not None:
        raise ValueError(f"more side tensors given than the {len(used)} gate calls")
    out = []
    for name in fidelity.output_names(joint):
        out.append(loss.detach() if name == "loss" else trained[name].grad.detach().clone())
    return out


def fp16_sides(model: nn.Module, inputs: Sequence) -> list[torch.Tensor]:
    """Every gate call's input in torch's fp16 forward (``fidelity.fp16_reference``'s
    kernels), as float32, in call order."""
    half = kinks.not_in_place(model).half()
    half_inputs = [
        t.detach().half() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
        for t in inputs
    ]
    sides: list[torch.Tensor] = []
    with torch.no_grad(), fp16_kernels():
        kinks.hooked_forward(half, half_inputs, lambda g, k, x, y: sides.append(x.float()))
    return sides


def flipped(model: nn.Module, inputs: Sequence, sides: Sequence[torch.Tensor]) -> dict[str, int]:
    """Per gate call, how many elements ``sides`` gives another slope than fp32's own."""
    probe = kinks.not_in_place(model)
    gates = dict(probe.named_modules())
    counts: dict[str, int] = {}
    given = iter(sides)

    def record(gate, _kinks, x, _y):
        module = gates[gate.rsplit("#", 1)[0]]
        x = x.detach()
        counts[gate] = int((slope(module, x, x) != slope(module, x, next(given))).sum())

    with torch.no_grad(), pinned():
        kinks.hooked_forward(probe, inputs, record)
    return counts


@dataclasses.dataclass(frozen=True)
class Matched:
    """One step judged with each side's own gate decisions."""

    report: fidelity.Report  # HTP vs fp32 on the HTP's gates; floor: fp16 on fp16's
    flips_htp: dict[str, int]  # per gate call, slopes the HTP's forward changed
    flips_fp16: dict[str, int]  # the same for torch's fp16 forward

    def summary(self) -> str:
        htp, half = sum(self.flips_htp.values()), sum(self.flips_fp16.values())
        return f"{self.report.verdict()}; slopes flipped: HTP {htp}, torch fp16 {half}"


def assess(
    model: nn.Module,
    inputs: Sequence,
    joint: torch.export.ExportedProgram,
    htp: Sequence[torch.Tensor],
    htp_sides: Sequence[torch.Tensor],
) -> Matched:
    """``htp`` (the joint program's outputs on ``inputs``) against fp32 on the HTP's
    gate decisions ``htp_sides``, beside torch fp16 against fp32 on its own."""
    half_sides = fp16_sides(model, inputs)
    on_htp = matched_step(model, inputs, joint, htp_sides)
    on_half = matched_step(model, inputs, joint, half_sides)
    half = fidelity.fp16_reference(model, inputs, joint)
    names = fidelity.output_names(joint)
    htp = list(htp)[: len(names)]
    if len(htp) != len(names):
        raise ValueError(f"{len(htp)} HTP outputs for the joint program's {len(names)}")
    rows = [
        fidelity.Row(name, fidelity.Metrics.of(h, r), fidelity.Metrics.of(f, q))
        for name, h, r, f, q in zip(names, htp, on_htp, half, on_half)
    ]
    return Matched(
        fidelity.Report(rows),
        flipped(model, inputs, htp_sides),
        flipped(model, inputs, half_sides),
    )
