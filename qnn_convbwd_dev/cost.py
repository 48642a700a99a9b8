"""What a lowered training program costs: multiply-adds, stored bytes, planned memory.

``measure`` lowers a training case twice, with the plugin (every backward the
rules accept on the HTP) and with every ``convolution_backward`` and
``max_pool2d_with_indices_backward`` kept on CPU through executorch's
``skip_node_op_set``, and reports for each:

* **multiply-adds** of every QNN op that multiplies (``MAC_OPS``), computed from
  the tensor dimensions of the QNN graph the plugin built
  (``integration.capture_qnn_graphs``), plus those of the convolutions and
  matrix products left on CPU, against the **ideal** training step of the torch
  model (``ideal_macs``);
* **static bytes** each frozen weight takes in the QNN graphs against its own size;
* executorch's **planned memory** (the ``forward`` plan's non-constant buffers:
  tensors executorch holds, not the QNN delegates' own working memory), the
  input + output bytes of each delegate call, the ``.pte`` and the QNN
  context-binary bytes.

MACs from dimensions (QNN filter layouts, the op's parameters are not needed):

* ``Conv2d`` / ``Conv3d`` / ``DepthWiseConv2d``: filter ``[*k, in/groups, out]``
  (depthwise: ``[*k, 1, out]``), MACs = numel(output) * prod(k) * filter[-2];
* ``TransposeConv2d`` / ``TransposeConv3d``: filter ``[*k, in, out/groups]``,
  every input element is scattered into prod(k) * out/groups outputs, MACs =
  numel(input) * prod(k) * filter[-1] (elements later cropped by the padding count);
* ``FullyConnected``: weight ``[units, K]``, MACs = numel(output) * K;
* ``MatMul``: the last two dims of in[0] hold M * K in either order
  (``transpose_in0``), MACs = numel(output) * (in0[-2] * in0[-1] / out[-2]).

Dilation and stride do not change these counts; padded zeros are counted, as
torch's own ``FlopCounterMode`` counts them.

The ideal: forward MACs of every ``nn.Conv*`` / ``nn.Linear`` of the model (forward
hooks), plus the same count again for grad_input where a gradient flows to the
layer's input (the input requires grad) and for grad_weight where its weight is
trainable.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable

import torch
from torch import nn

from qnn_convbwd import integration, options
from qnn_convbwd.commands import train_cli
from qnn_convbwd.integration import QnnOpInfo, QnnTensorInfo

from . import models

MAC_OPS = (
    "Conv2d",
    "DepthWiseConv2d",
    "TransposeConv2d",
    "Conv3d",
    "TransposeConv3d",
    "FullyConnected",
    "MatMul",
)
# executorch's skip_node_op_set that keeps every backward op on CPU.
BACKWARD_ON_CPU = frozenset(
    {"aten.convolution_backward.default", "aten.max_pool2d_with_indices_backward.default"}
)
PHASES = ("forward", "grad_input", "grad_weight")


def qnn_op_macs(op: QnnOpInfo) -> int | None:
    """Multiply-adds of one QNN op from its tensor dims; None for ops that do not multiply."""
    if op.op_type not in MAC_OPS:
        return None
    out = op.outputs[0].dims
    if op.op_type in ("Conv2d", "Conv3d", "DepthWiseConv2d"):
        filt = op.inputs[1].dims
        return math.prod(out) * math.prod(filt[:-1])
    if op.op_type in ("TransposeConv2d", "TransposeConv3d"):
        filt = op.inputs[1].dims
        return math.prod(op.inputs[0].dims) * math.prod(filt[:-2]) * filt[-1]
    if op.op_type == "FullyConnected":
        return math.prod(out) * op.inputs[1].dims[-1]
    a = op.inputs[0].dims  # MatMul
    if len(a) < 2 or len(out) < 2:
        return math.prod(out) * a[-1]
    return math.prod(out) * (a[-2] * a[-1] // out[-2])


def saver_op_macs(graph: object) -> dict[str, int]:
    """MACs per QNN op type of a Saver recording (``toolchain.saver.SaverGraph``)."""
    tensors = graph.tensors  # type: ignore[attr-defined]

    def info(name: str) -> QnnTensorInfo:
        t = tensors[name]
        return QnnTensorInfo(name, t.type, tuple(t.dims), len(t.data or b""))

    totals: dict[str, int] = {}
    for op in graph.ops:  # type: ignore[attr-defined]
        macs = qnn_op_macs(
            QnnOpInfo(
                op.name,
                op.type,
                tuple(info(n) for n in op.inputs),
                tuple(info(n) for n in op.outputs),
            )
        )
        if macs is not None:
            totals[op.type] = totals.get(op.type, 0) + macs
    return totals


# --- the ideal step, from the torch model -------------------------------------------


@dataclasses.dataclass(frozen=True)
class LayerMacs:
    name: str  # module path
    kind: str  # module class name
    forward: int
    grad_input: int  # forward MACs when a gradient flows to the layer's input, else 0
    grad_weight: int  # forward MACs when the weight is trainable, else 0

    @property
    def total(self) -> int:
        return self.forward + self.grad_input + self.grad_weight


def _forward_macs(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    weight = module.weight
    if isinstance(module, nn.Linear):
        return y.numel() * weight.shape[1]
    if isinstance(module, nn.modules.conv._ConvTransposeNd):
        # weight [in, out/groups, *k]: each input element feeds out/groups * prod(k) outputs
        return x.numel() * math.prod(weight.shape[1:])
    return y.numel() * math.prod(weight.shape[1:])  # weight [out, in/groups, *k]


def ideal_macs(model: nn.Module, inputs: Iterable[torch.Tensor]) -> list[LayerMacs]:
    """Per conv / linear layer of ``model``, the MACs one training step needs at least."""
    layers: list[LayerMacs] = []
    handles = []

    def hook(name: str):
        def record(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            x = args[0]
            fwd = _forward_macs(module, x, output)
            layers.append(
                LayerMacs(
                    name,
                    type(module).__name__,
                    fwd,
                    fwd if x.requires_grad else 0,
                    fwd if module.weight.requires_grad else 0,
                )
            )

        return record

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear | nn.modules.conv._ConvNd):
            handles.append(module.register_forward_hook(hook(name)))
    try:
        with torch.enable_grad():
            model(*inputs)
    finally:
        for handle in handles:
            handle.remove()
    return layers


# --- what stays on CPU -----------------------------------------------------------------


def _numel(node: object) -> int:
    return node.meta["val"].numel()  # type: ignore[attr-defined]


def _shape(node: object) -> tuple[int, ...]:
    return tuple(node.meta["val"].shape)  # type: ignore[attr-defined]


def _op_name(node: torch.fx.Node) -> str:
    """``aten.<op>.<overload>`` of an edge or aten op."""
    text = str(node.target)
    return text[len("<EdgeOpOverload: ") : text.index(">")] if text.startswith("<Edge") else text


def cpu_node_macs(node: torch.fx.Node) -> tuple[str, int] | None:
    """(op name, MACs) of a convolution or matrix product executorch runs on CPU."""
    if node.op != "call_function":
        return None
    name = _op_name(node)
    op = name.split(".")[1] if name.startswith("aten.") else ""
    args = node.args
    if op == "convolution":
        x, weight, transposed = args[0], args[1], args[6]
        count = _numel(x) if transposed else _numel(node)
        return name, count * math.prod(_shape(weight)[1:])
    if op == "convolution_backward":
        grad_output, x, weight, transposed, mask = args[0], args[1], args[2], args[7], args[10]
        forward = (_numel(x) if transposed else _numel(grad_output)) * math.prod(_shape(weight)[1:])
        return name, forward * (int(bool(mask[0])) + int(bool(mask[1])))
    if op in ("mm", "bmm"):
        return name, _numel(node) * _shape(args[0])[-1]
    if op == "addmm":
        return name, _numel(node) * _shape(args[1])[-1]
    if op == "linear":
        return name, _numel(node) * _shape(args[1])[-1]
    return None


def cpu_macs(edge: object) -> dict[str, int]:
    """MACs per op of the convolutions and matrix products outside every delegate."""
    totals: dict[str, int] = {}
    for node in edge.exported_program().graph.nodes:  # type: ignore[attr-defined]
        found = cpu_node_macs(node)
        if found is not None:
            totals[found[0]] = totals.get(found[0], 0) + found[1]
    return totals


# --- bytes and memory --------------------------------------------------------------------

_SUFFIX = re.compile(r"@\d+$")


@dataclasses.dataclass(frozen=True)
class WeightBytes:
    parameter: str
    shape: tuple[int, ...]
    size: int  # numel * the element bytes of its static QNN tensors (fp32 unless noted)
    static: int  # bytes of every static QNN tensor made from it, all partitions
    tensors: tuple[str, ...]  # "<partition>:<static tensor name>"

    @property
    def ratio(self) -> float:
        return self.static / self.size if self.size else float("nan")

    @property
    def partitions(self) -> int:
        return len({t.split(":", 1)[0] for t in self.tensors})


def static_tensors(graphs: list[list[QnnOpInfo]]) -> dict[tuple[int, str], QnnTensorInfo]:
    """Every static QNN tensor, by (partition index, name): each partition stores its own."""
    found = {}
    for index, ops in enumerate(graphs):
        for op in ops:
            for tensor in (*op.inputs, *op.outputs):
                if tensor.is_static:
                    found[(index, tensor.name)] = tensor
    return found


def frozen_weight_bytes(model: nn.Module, graphs: list[list[QnnOpInfo]]) -> list[WeightBytes]:
    """For each frozen parameter, the static QNN tensors named after it and their bytes.

    A static tensor belongs to parameter ``a.b`` when its name, without
    executorch's ``@<n>`` suffix, is ``p_a_b`` or starts with ``p_a_b_`` (the
    longest such parameter name wins).
    """
    placeholders = {
        "p_" + name.replace(".", "_"): (name, param)
        for name, param in model.named_parameters()
        if not param.requires_grad
    }
    owned: dict[str, list[tuple[str, QnnTensorInfo]]] = {p: [] for p in placeholders}
    for (index, name), tensor in static_tensors(graphs).items():
        base = _SUFFIX.sub("", name)
        owner = max(
            (p for p in placeholders if base == p or base.startswith(p + "_")),
            key=len,
            default=None,
        )
        if owner is not None:
            owned[owner].append((f"{index}:{name}", tensor))
    rows = []
    for placeholder, (name, param) in placeholders.items():
        mine = owned[placeholder]
        width = next((t.nbytes // math.prod(t.dims) for _, t in mine if math.prod(t.dims)), 4)
        rows.append(
            WeightBytes(
                name,
                tuple(param.shape),
                param.numel() * width,
                sum(t.nbytes for _, t in mine),
                tuple(label for label, _ in mine),
            )
        )
    return rows


# --- bytes by value: which static tensors hold a frozen weight's values --------------------

# A frozen weight counts for the 0.05 rule when it takes this many bytes in fp16,
# the precision the HTP stores it in (numel >= 32,768).
LARGE_WEIGHT_BYTES = 64 * 1024
FP16_BYTES = 2
# A static tensor holds a weight's values when at least this share of its nonzero
# elements are values of that weight (and no other weight has more of them).
VALUE_SHARE = 0.9


@dataclasses.dataclass(frozen=True)
class WeightCopies:
    """The static QNN tensors holding one frozen weight's values, found by value."""

    parameter: str
    shape: tuple[int, ...]
    size: int  # numel * 4: the weight as the fp32 static tensor executorch declares
    # (name, bytes, share of the weight's values, ops reading it)
    tensors: tuple[tuple[str, int, float, int], ...]
    held: float = 0.0  # share of the weight's values its static tensors hold together

    @property
    def static(self) -> int:
        return sum(t[1] for t in self.tensors)

    @property
    def extra(self) -> int:
        """Static bytes beyond one copy of the weight: copies, padding, re-laid-out tensors."""
        return self.static - self.size

    @property
    def ratio(self) -> float:
        """``extra`` over the weight's own size: the 0.05 rule's measure."""
        return self.extra / self.size

    @property
    def coverage(self) -> float:
        """Share of the weight's values its static tensors hold together (1.0: all of
        them, in one tensor or split, as ``runtime_weight``'s head and tail)."""
        return self.held

    @property
    def readers(self) -> int:
        """The most ops reading any one of its static tensors: the HTP prepares a
        static tensor once per reading op type (docs/weight_bytes.md), so 1 leaves
        it nothing to copy (``runtime_weight`` splits a weight into two static
        tensors, each read by one op)."""
        return max((t[3] for t in self.tensors), default=0)

    @property
    def large(self) -> bool:
        return math.prod(self.shape) * FP16_BYTES >= LARGE_WEIGHT_BYTES


@dataclasses.dataclass(frozen=True)
class StaticByValue:
    weights: list[WeightCopies]
    unattributed: tuple[tuple[str, int], ...]  # static float tensors holding no weight's values
    static_bytes: int  # every static op input of the graph

    def large(self) -> list[WeightCopies]:
        return [w for w in self.weights if w.large]

    def worst(self) -> WeightCopies | None:
        return max(self.large(), key=lambda w: w.ratio, default=None)


def _share(sorted_values, x) -> float:
    """Share of the elements of ``x`` that occur in ``sorted_values``."""
    import numpy as np

    if not x.size or not sorted_values.size:
        return 0.0
    at = np.clip(np.searchsorted(sorted_values, x), 0, sorted_values.size - 1)
    return float(np.mean(sorted_values[at] == x))


def weight_copies(
    model: nn.Module,
    graph: object,
    min_elements: int = 64,
    stored: dict[str, torch.Tensor] | None = None,
) -> StaticByValue:
    """Attribute the float static tensors of a Saver recording to frozen conv weights by value.

    ``graph`` is a ``toolchain.saver.SaverGraph`` (the QNN graph as QNN received
    it, with its static data). Names are not trusted: a weight's transposed,
    sliced, zero-dilated or padded copy made by any pass has a name of its own
    but holds the weight's values. Each static float tensor of at least
    ``min_elements`` elements goes to the frozen weight (dim >= 3: convolutions)
    of which it holds the largest share of its nonzero values, if that share is
    at least ``VALUE_SHARE``; its bytes (padding included) count for that weight.
    Shares are per weight: two weights of similar scale share many fp32 values
    (resnet18's 11 M frozen values do), so a value alone does not name its
    weight, but a copy's values all lie in one weight. ``stored`` gives, by
    parameter name, the values the lowering stores in place of a weight (a weight
    with its batch norm folded in; default: the recording's ``folded_weights``, what
    ``passes.conv_batch_norm.observe_folds`` saw while it was recorded).
    """
    import numpy as np

    if stored is None:
        stored = getattr(graph, "folded_weights", None) or {}
    frozen = [
        (name, stored.get(name, p).detach().to(torch.float32).numpy().ravel())
        for name, p in model.named_parameters()
        if not p.requires_grad and p.dim() >= 3
    ]
    ordered = [np.sort(v) for _, v in frozen]
    found: dict[int, list[tuple[str, int, float, int]]] = {i: [] for i in range(len(frozen))}
    held: dict[int, list] = {i: [] for i in range(len(frozen))}
    unattributed = []
    for tensor in graph.static_inputs():  # type: ignore[attr-defined]
        if not tensor.dtype_name.startswith("FLOAT") or tensor.numel < min_elements:
            continue
        data = graph.tensor_array(tensor.name).astype(np.float32).ravel()  # type: ignore[attr-defined]
        nonzero = data[data != 0]
        best, share = -1, 0.0
        if frozen and nonzero.size:
            sample = nonzero[:: max(1, nonzero.size // 4096)]  # to pick the candidate
            best = int(np.argmax([_share(values, sample) for values in ordered]))
            share = _share(ordered[best], nonzero)
        if best >= 0 and share >= VALUE_SHARE:
            covered = _share(np.sort(nonzero), frozen[best][1])
            readers = len(graph.consumers(tensor.name))  # type: ignore[attr-defined]
            found[best].append((tensor.name, len(tensor.data or b""), covered, readers))
            held[best].append(nonzero)
        else:
            unattributed.append((tensor.name, len(tensor.data or b"")))
    params = dict(model.named_parameters())
    weights = [
        WeightCopies(
            name,
            tuple(params[name].shape),
            v.size * 4,
            tuple(found[i]),
            _share(np.sort(np.concatenate(held[i])), v) if held[i] else 0.0,
        )
        for i, (name, v) in enumerate(frozen)
    ]
    return StaticByValue(weights, tuple(unattributed), graph.static_bytes)  # type: ignore[attr-defined]


def _bytes(value: object) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_bytes(v) for v in value)
    return 0


def delegate_io_bytes(edge: object) -> list[tuple[int, int]]:
    """(input bytes, output bytes) of each delegate call, in graph order.

    Every input and output of one call is alive in executorch's planned memory
    while it runs (unless it is a constant or a program input).
    """
    sizes = []
    for node in edge.exported_program().graph.nodes:  # type: ignore[attr-defined]
        if node.op == "call_function" and "executorch_call_delegate" in str(node.target):
            inputs = sum(
                _bytes(a.meta.get("val")) for a in node.args[1:] if isinstance(a, torch.fx.Node)
            )
            sizes.append((inputs, _bytes(node.meta.get("val"))))
    return sizes


def planned_memory(program: object) -> int:
    """Bytes of executorch's planned (non-constant) buffers of the ``forward`` method."""
    plans = program.executorch_program.execution_plan  # type: ignore[attr-defined]
    plan = next((p for p in plans if p.name == "forward"), plans[0])
    return sum(plan.non_const_buffer_sizes)


# --- one lowering, measured ----------------------------------------------------------------


@dataclasses.dataclass
class Lowered:
    label: str
    qnn_macs: dict[str, int]  # QNN op type -> MACs, all partitions
    cpu_macs: dict[str, int]  # aten op -> MACs outside the delegates
    weights: list[WeightBytes]
    static_bytes: int  # every static QNN tensor
    planned: int
    pte: int
    context: int
    delegates: int
    backward_delegated: str  # "k of n" convolution_backward
    on_cpu: list[str]  # ops outside every delegate
    delegate_io: list[tuple[int, int]]  # (input, output) bytes per delegate call
    seconds: float = 0.0  # qnn_convbwd.lower, wall time

    @property
    def total_macs(self) -> int:
        return sum(self.qnn_macs.values()) + sum(self.cpu_macs.values())


@dataclasses.dataclass
class CostReport:
    name: str
    soc: str
    ideal: list[LayerMacs]
    lowerings: list[Lowered]

    def ideal_total(self, phase: str | None = None) -> int:
        if phase is None:
            return sum(layer.total for layer in self.ideal)
        return sum(getattr(layer, phase) for layer in self.ideal)


def measure_lowering(
    case: models.TrainingCase, soc: str, label: str, skip_node_op_set: set | None = None
) -> Lowered:
    return measure_program(case.joint(), case.model, soc, label, skip_node_op_set)


def measure_program(
    joint: torch.export.ExportedProgram,
    model: nn.Module,
    soc: str,
    label: str,
    skip_node_op_set: set | None = None,
) -> Lowered:
    """Lower the joint graph ``joint`` of ``model`` with ``qnn_convbwd.lower`` and measure it."""
    import time

    from qnn_convbwd import api
    from qnn_convbwd.toolchain import harness

    specs = harness.compile_specs(soc)
    start = time.perf_counter()
    with integration.capture_qnn_graphs() as graphs:
        result = api.lower(joint, specs, skip_node_op_set=skip_node_op_set)
    seconds = time.perf_counter() - start
    program = result.edge.to_executorch()
    qnn: dict[str, int] = {}
    for ops in graphs:
        for op in ops:
            macs = qnn_op_macs(op)
            if macs is not None:
                qnn[op.op_type] = qnn.get(op.op_type, 0) + macs
    report = result.report
    return Lowered(
        label=label,
        qnn_macs=qnn,
        cpu_macs=cpu_macs(result.edge),
        weights=frozen_weight_bytes(model, graphs),
        static_bytes=sum(t.nbytes for t in static_tensors(graphs).values()),
        planned=planned_memory(program),
        pte=len(program.buffer),
        context=sum(len(b) for b in harness.context_binaries(result.edge)),
        delegates=harness.delegate_count(result.edge),
        backward_delegated=f"{report.delegated} of {len(report.rows)}",
        on_cpu=train_cli.cpu_ops(result.edge),
        delegate_io=delegate_io_bytes(result.edge),
        seconds=seconds,
    )


def measure(
    case: models.TrainingCase, soc: str = "SM8650", cpu_baseline: bool = True
) -> CostReport:
    """The plugin's lowering of ``case`` and, when asked, every backward kept on CPU."""
    lowerings = [measure_lowering(case, soc, "plugin")]
    if cpu_baseline:
        lowerings.append(measure_lowering(case, soc, "backward on CPU", set(BACKWARD_ON_CPU)))
    return CostReport(case.name, soc, ideal_macs(case.model, case.inputs), lowerings)


# --- text ----------------------------------------------------------------------------------


def _ratio(a: int, b: int) -> str:
    return f"{a / b:.2f}" if b else "-"


def to_markdown(report: CostReport) -> str:
    ideal = report.ideal_total()
    lines = [
        f"### {report.name} on {report.soc}",
        "",
        "Ideal MACs of one training step: "
        + ", ".join(f"{p} {report.ideal_total(p):,}" for p in PHASES)
        + f"; total {ideal:,}.",
        "",
        "| lowering | where | op | MACs | / ideal total |",
        "|---|---|---|---|---|",
    ]
    for low in report.lowerings:
        for op, macs in sorted(low.qnn_macs.items()):
            lines.append(f"| {low.label} | HTP | {op} | {macs:,} | {_ratio(macs, ideal)} |")
        for op, macs in sorted(low.cpu_macs.items()):
            lines.append(f"| {low.label} | CPU | {op} | {macs:,} | {_ratio(macs, ideal)} |")
        lines.append(
            f"| {low.label} | all | **total** | **{low.total_macs:,}** | "
            f"**{_ratio(low.total_macs, ideal)}** |"
        )
    lines += [
        "",
        "| lowering | convolution_backward delegated | delegates | static QNN bytes "
        "| context bytes | .pte bytes | planned memory (forward) | largest delegate in + out |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for low in report.lowerings:
        lines.append(
            f"| {low.label} | {low.backward_delegated} | {low.delegates} | "
            f"{low.static_bytes:,} | {low.context:,} | {low.pte:,} | {low.planned:,} | "
            f"{max((i + o for i, o in low.delegate_io), default=0):,} |"
        )
    lines.append("")
    lines += [
        f"* on CPU ({low.label}): {', '.join(low.on_cpu) or 'nothing'}" for low in report.lowerings
    ]
    frozen = [(low, w) for low in report.lowerings for w in low.weights]
    if frozen:
        lines += [
            "",
            "| lowering | frozen parameter | shape | size B | static QNN B | tensors "
            "| partitions | ratio |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for low, w in frozen:
            shape = "x".join(map(str, w.shape))
            lines.append(
                f"| {low.label} | {w.parameter} | {shape} | {w.size:,} | {w.static:,} | "
                f"{len(w.tensors)} | {w.partitions} | {w.ratio:.2f} |"
            )
    return "\n".join(lines)


# --- CLI: qnn-convbwd cost ---------------------------------------------------------------


def add_arguments(parser) -> None:
    parser.add_argument("--model", choices=sorted(models.TRAINING_MODELS), default="cifar")
    parser.add_argument("--soc", default="SM8650", help="target SoC (default SM8650, HTP V75)")
    scheme = parser.add_mutually_exclusive_group()
    scheme.add_argument("--frozen", dest="trainable", action="store_false", help="(default)")
    scheme.add_argument("--trainable", dest="trainable", action="store_true")
    parser.set_defaults(trainable=False)
    parser.add_argument(
        "--stride",
        choices=options.STRIDE_MODES,
        default=None,
        help="Options.stride for the plugin's lowering (default: the default)",
    )
    parser.add_argument(
        "--no-cpu-baseline",
        dest="cpu_baseline",
        action="store_false",
        help="skip the lowering with every backward op kept on CPU",
    )


def run(args) -> int:
    from qnn_convbwd import api

    case = models.TRAINING_MODELS[args.model](args.trainable)
    with api.enabled(**({"stride": args.stride} if args.stride else {})):
        print(to_markdown(measure(case, args.soc, args.cpu_baseline)))
    return 0


__all__ = [
    "BACKWARD_ON_CPU",
    "MAC_OPS",
    "CostReport",
    "LARGE_WEIGHT_BYTES",
    "LayerMacs",
    "Lowered",
    "StaticByValue",
    "WeightBytes",
    "WeightCopies",
    "cpu_macs",
    "delegate_io_bytes",
    "frozen_weight_bytes",
    "ideal_macs",
    "measure",
    "measure_program",
    "planned_memory",
    "qnn_op_macs",
    "saver_op_macs",
    "static_tensors",
    "to_markdown",
    "weight_copies",
]
