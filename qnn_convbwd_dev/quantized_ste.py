"""Trainable layers before and between the blocks of a pt2e-quantized frozen backbone,
trained through the straight-through estimator (docs/quantized.md).

The model is ExecuTorch's CIFAR example: its ``features`` (three conv / relu / max-pool
blocks) calibrated and converted with executorch's ``QnnQuantizer`` (per-channel
convolution weights), as ``quantized_backbone.quantized_cifar`` does, but in two
pieces: the first block and the other two, so that an adapter can sit between them.
What trains:

* ``"input"``: a 1x1 convolution on the input (initialised to the identity);
* ``"between"``: a per-channel scale and bias between the first block and the rest
  (initialised to 1 and 0);
* the classifier (float).

The reference is the same module after ``quantized.straight_through`` in fp32 torch,
trained by ``torch.optim.SGD``.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from qnn_convbwd import quantized

from . import quantized_backbone as qb

ADAPTERS = ("input", "between")
# ``build``'s torchvision choice of adapters inside the backbone (``adapted_inside``).
INSIDE = "inside"
FIRST_BLOCK = 3  # modules of ``features`` in the first block: conv, relu, max pool


class ChannelAffine(nn.Module):
    """``x * scale + bias`` per channel (NCHW), from the identity."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1, channels, 1, 1))
        self.bias = nn.Parameter(torch.zeros(1, channels, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.bias


class AdaptedBackbone(nn.Module):
    """An input adapter, the first converted block, an adapter, the other converted
    blocks, the float classifier."""

    def __init__(self, first: nn.Module, rest: nn.Module, head: nn.Module, adapters) -> None:
        super().__init__()
        self.input_adapter = nn.Conv2d(3, 3, 1) if "input" in adapters else nn.Identity()
        if isinstance(self.input_adapter, nn.Conv2d):
            with torch.no_grad():
                self.input_adapter.weight.copy_(torch.eye(3).view(3, 3, 1, 1))
                self.input_adapter.bias.zero_()
        self.first = first
        channels = int(first(torch.zeros(qb.BATCH, 3, qb.SIZE, qb.SIZE)).shape[1])
        self.between = ChannelAffine(channels) if "between" in adapters else nn.Identity()
        self.rest = rest
        self.classifier = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.rest(self.between(self.first(self.input_adapter(x))))
        return self.classifier(torch.flatten(y, 1))


def _converted(module: nn.Module, batches: list[torch.Tensor], dtype: str) -> nn.Module:
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    exported = torch.export.export(module, (batches[0],), strict=True).module()
    prepared = prepare_pt2e(exported, quantized.quantizer(dtype))
    for batch in batches:
        prepared(batch)
    return convert_pt2e(prepared)


def adapted_cifar(
    dtype: str = "8a8w", adapters: tuple[str, ...] = ADAPTERS, seed: int = 0
) -> AdaptedBackbone:
    """ExecuTorch's CIFAR model (weights from ``seed``), its features quantized with
    ``dtype`` in two pieces calibrated on seeded batches, with ``adapters`` (a subset of
    ``ADAPTERS``); the adapters and the classifier train, in eval() (no dropout)."""
    from qnn_convbwd import finetune

    unknown = sorted(set(adapters) - set(ADAPTERS))
    if unknown:
        raise ValueError(f"unknown adapters {unknown}: choose from {', '.join(ADAPTERS)}")
    net = finetune.architecture("cifar", seed=seed).eval()
    gen = torch.Generator().manual_seed(seed)
    images = [
        torch.randn(qb.BATCH, 3, qb.SIZE, qb.SIZE, generator=gen)
        for _ in range(qb.CALIBRATION_BATCHES)
    ]
    first_float = net.features[:FIRST_BLOCK]
    with torch.no_grad():
        middle = [first_float(batch) for batch in images]
    first = _converted(first_float, images, dtype)
    rest = _converted(net.features[FIRST_BLOCK:], middle, dtype)
    model = AdaptedBackbone(first, rest, net.classifier, adapters)
    frozen = ("first.", "rest.")
    for name, parameter in model.named_parameters():
        # The converted graphs keep the float originals of the quantized weights as
        # unused attributes: they stay frozen.
        parameter.requires_grad_(not name.startswith(frozen))
    return model


class InputAdapted(nn.Module):
    """A trainable 1x1 convolution (from the identity) in front of a converted model."""

    def __init__(self, converted: nn.Module, channels: int = 3) -> None:
        super().__init__()
        self.input_adapter = nn.Conv2d(channels, channels, 1)
        with torch.no_grad():
            self.input_adapter.weight.copy_(torch.eye(channels).view(channels, channels, 1, 1))
            self.input_adapter.bias.zero_()
        self.model = converted

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(self.input_adapter(x))


def adapted_torchvision(
    name: str, dtype: str = "8a8w", seed: int = 0, mode: str = "split", head: bool = False
) -> InputAdapted:
    """torchvision's ``name`` (seeded random weights, 10 classes, eval()) quantized with
    ``dtype`` and calibrated on seeded 32x32 batches, behind a trainable input adapter.

    ``mode="split"`` (``name`` one of ``quantized_backbone.MODELS``): the backbone
    quantized alone under its float head (``quantized_backbone.quantized_model``, batch
    norms with running statistics from train-mode passes); the head trains too when
    ``head``. ``mode="whole"``: the whole model quantized, its classifier included, the
    adapter alone training (torchvision's initial statistics)."""
    from qnn_convbwd.torchvision_import import import_torchvision

    if mode == "split":
        model = InputAdapted(qb.quantized_model(name, dtype, "split", seed))
        trains = (
            ("input_adapter.", f"model.{model.model.head_name}.") if head else ("input_adapter.",)
        )
    elif mode == "whole":
        if head:
            raise ValueError("head=True needs mode='split': a quantized head does not train")
        torchvision = import_torchvision()
        torch.manual_seed(seed)
        net = getattr(torchvision.models, name)(num_classes=10).eval()
        gen = torch.Generator().manual_seed(seed)
        images = [
            torch.randn(qb.BATCH, 3, qb.SIZE, qb.SIZE, generator=gen)
            for _ in range(qb.CALIBRATION_BATCHES)
        ]
        model = InputAdapted(_converted(net, images, dtype))
        trains = ("input_adapter.",)
    else:
        raise ValueError(f"unknown mode {mode!r}: one of {', '.join(qb.MODES)}")
    for parameter_name, parameter in model.named_parameters():
        parameter.requires_grad_(parameter_name.startswith(trains))
    return model


def adapted_inside(
    name: str, dtype: str = "8a8w", seed: int = 0, spread: float = 0.05, trained: bool = False
):
    """``quantized_backbone.float_model(name, seed, trained)`` with
    ``finetune.apply_scheme(..., "adapter")``'s residual adapters, its backbone quantized
    with the adapters left float (``finetune.quantize_for_fit``'s split, calibrated on
    ``quantized_backbone.calibration_batches(seed, trained)``: seeded random batches, or
    the digits with ``trained``); the adapters' weights drawn from N(0, ``spread``) so
    that they change the forward. The adapters and the head child train."""
    from qnn_convbwd import finetune

    net = finetune.apply_scheme(qb.float_model(name, seed, trained), "adapter")
    adapters = [
        f"{n}.adapter" for n, m in net.named_modules() if isinstance(m, finetune.ResidualAdapter)
    ]
    model = quantized.quantize_backbone(
        net,
        finetune.head(net),
        dtype,
        qb.calibration_batches(seed, trained),
        float_modules=adapters,
    )
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if ".adapter." in parameter_name:
                parameter.copy_(torch.randn(parameter.shape, generator=gen) * spread)
    return model.eval()


def qat_cifar(dtype: str = "8a8w", qat_steps: int = 3, seed: int = 0) -> InputAdapted:
    """ExecuTorch's CIFAR model trained for ``qat_steps`` SGD steps with
    quantization-aware training of its features (``QnnQuantizer(is_qat=True)``,
    ``prepare_qat_pt2e``), then converted (``convert_pt2e``) and put behind a trainable
    input adapter; the adapter and the classifier train on."""
    from torchao.quantization.pt2e import move_exported_model_to_eval
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_qat_pt2e

    from qnn_convbwd import finetune

    net = finetune.architecture("cifar", seed=seed).eval()
    quantizer = quantized.quantizer(dtype, qat=True)
    example = torch.zeros(qb.BATCH, 3, qb.SIZE, qb.SIZE)
    features = torch.export.export(net.features, (example,), strict=True).module()
    prepared = prepare_qat_pt2e(features, quantizer)
    head = net.classifier
    optimizer = torch.optim.SGD([*prepared.parameters(), *head.parameters()], lr=0.01)
    for x, y in qb.batches(qat_steps, seed=seed + 100):
        loss = nn.functional.cross_entropy(head(torch.flatten(prepared(x), 1)), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    move_exported_model_to_eval(prepared)
    model = InputAdapted(qb.QuantizedBackbone(convert_pt2e(prepared), head, "classifier"))
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name.startswith(("input_adapter.", "model.classifier.")))
    return model


def reference(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with the straight-through estimator: what torch trains."""

    result = copy.deepcopy(model)
    quantized.straight_through(result)
    return result


def _reference(model: nn.Module, fused: bool) -> nn.Module:
    """``reference`` of ``model``, or of ``fused_activations(model)`` with ``fused``."""
    return reference(qb.fused_activations(model) if fused else model)


def torch_losses(start: nn.Module, data: list, lr: float) -> list[float]:
    """Torch's loss per SGD step at ``lr`` on ``data``, training a copy of ``start``."""
    trained = copy.deepcopy(start)
    optimizer = torch.optim.SGD([p for p in trained.parameters() if p.requires_grad], lr=lr)
    found = []
    for x, y in data:
        loss = nn.functional.cross_entropy(trained(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        found.append(loss.item())
    return found


def _with_estimators(model: nn.Module, make) -> nn.Module:
    """``reference(model)`` with each estimator node's target ``make(node.name)``."""
    ref = reference(model)
    target = torch.ops.qnn_convbwd.straight_through_quantize.default
    for graph_module in ref.modules():
        if not isinstance(graph_module, torch.fx.GraphModule):
            continue
        for node in graph_module.graph.nodes:
            if node.op == "call_function" and node.target == target:
                node.target = make(node.name)
        graph_module.recompile()
    return ref


def clamped_elements(model: nn.Module, x: torch.Tensor) -> dict[str, int]:
    """Per activation quantize of ``reference(model)`` (by node name), how many elements
    of its input lie beyond the calibrated range on ``x``: where torch's estimator zeroes
    the gradient and the HTP's, reading the stored value, passes it (docs/quantized.md,
    "Clamped gradients on the HTP")."""
    found: dict[str, int] = {}

    def counting(name: str):
        def quantize(x, scale, zero_point, quant_min, quant_max, dtype, low, high):
            found[name] = found.get(name, 0) + int(((x < low) | (x > high)).sum())
            return torch.ops.qnn_convbwd.straight_through_quantize(
                x, scale, zero_point, quant_min, quant_max, dtype, low, high
            )

        return quantize

    with torch.no_grad():
        _with_estimators(model, counting)(x)
    return found


def stored_value_reference(model: nn.Module) -> nn.Module:
    """``reference(model)`` whose estimators pass the gradient everywhere, clamped
    elements included: what the HTP's estimator computes, its mask reading the stored
    value, which always lies inside the range (docs/quantized.md)."""

    def passing(_name: str):
        def quantize(x, scale, zero_point, quant_min, quant_max, dtype, low, high):
            stored = torch.ops.qnn_convbwd.straight_through_quantize(
                x, scale, zero_point, quant_min, quant_max, dtype, low, high
            )
            return x + (stored - x).detach()

        return quantize

    return _with_estimators(model, passing)


def train_both(
    model: nn.Module, program, data: list, lr: float
) -> list[tuple[float, float, float]]:
    """(program loss, torch loss, the program step's wall seconds) per SGD step at
    ``lr`` from the same weights and batches; torch trains ``reference(model)``."""
    return qb.train_both(reference(model), program, data, lr)


def gradient_agreement(
    model: nn.Module, program, batch, torch_model: nn.Module | None = None
) -> dict[str, tuple[float, float]]:
    """Per trainable parameter, (cosine, norm ratio) of the program's gradient against
    torch's (``torch_model``, by default ``reference(model)``), from one SGD step at lr 1
    on ``batch``."""
    torch_model = reference(model) if torch_model is None else torch_model
    return gradient_agreements(program, batch, [torch_model])[0]


def gradient_agreements(
    program, batch, torch_models: Sequence[nn.Module]
) -> list[dict[str, tuple[float, float]]]:
    """``gradient_agreement`` against each of ``torch_models``, from one program step."""
    expected = [_gradients(m, batch) for m in torch_models]
    x, y = batch
    session = program.session(1.0)
    try:
        before = session.state_dict()
        session.step([x, y])
        after = session.state_dict()
    finally:
        session.close()
    results = []
    for grads in expected:
        result = {}
        for name, theirs in grads.items():
            ours = (before[name] - after[name]).flatten()
            cosine = float(ours @ theirs / (ours.norm() * theirs.norm()))
            result[name] = (cosine, float(ours.norm() / theirs.norm()))
        results.append(result)
    return results


@dataclasses.dataclass
class RoundingDeviation:
    """Torch against torch: the model's straight-through reference (the converted graph
    rounds a convolution's result, then its ReLU / ReLU6's) and the same with each pair
    rounded once (``quantized_backbone.fused_activations``, as the HTP computes it). Two
    emulations of one quantized model, neither the HTP's: how far the quantity the
    bound judges moves with the rounding alone."""

    losses: tuple[list[float], list[float]]  # per SGD step: unfused, fused
    gradients: dict[str, tuple[float, float]]  # per parameter: cosine, norm ratio

    @property
    def loss_gaps(self) -> list[float]:
        return [abs(a - b) for a, b in zip(*self.losses, strict=True)]


def _gradients(model: nn.Module, batch) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(model)
    x, y = batch
    nn.functional.cross_entropy(model(x), y).backward()
    return {n: p.grad.flatten() for n, p in model.named_parameters() if p.requires_grad}


def rounding_deviation(
    model: nn.Module, steps: int = 3, lr: float = qb.LR["cifar"], trained: bool = False
) -> RoundingDeviation:
    """``RoundingDeviation`` of ``model`` on the batches ``measure`` takes (the digits
    with ``trained``): ``steps`` SGD steps at ``lr`` of each reference, and one step's
    gradients."""
    data = qb.batches(steps + 2, trained=trained)
    unfused, fused = _reference(model, False), _reference(model, True)
    losses = [torch_losses(start, data[1:-1], lr) for start in (unfused, fused)]
    a, b = _gradients(unfused, data[-1]), _gradients(fused, data[-1])
    gradients = {
        name: (float(a[name] @ b[name] / (a[name].norm() * b[name].norm())),
               float(a[name].norm() / b[name].norm()))
        for name in a
    }  # fmt: skip
    return RoundingDeviation((losses[0], losses[1]), gradients)


@dataclasses.dataclass
class Measurement:
    model: str
    adapters: tuple[str, ...]
    dtype: str
    soc: str
    delegates: int
    on_cpu: int
    backward_convolutions: tuple[int, int]  # (delegated, all) convolution_backward nodes
    lower_seconds: float
    step_seconds: list[float]
    losses: list[float]  # torch's, per step
    loss_gaps: list[float]
    int8_bytes: int  # the converted model's int8 convolution weights
    static_bytes: int  # the QNN graph's static tensors
    context_bytes: int
    gradients: dict[str, tuple[float, float]]
    # against the reference that rounds each convolution / activation pair once
    # (``quantized_backbone.fused_activations``), as the HTP computes them
    fused_loss_gaps: list[float]
    fused_gradients: dict[str, tuple[float, float]]


def build(
    model_name: str,
    dtype: str,
    adapters: tuple[str, ...],
    head: bool = False,
    trained: bool = False,
):
    """``(model, adapters)``: ``"cifar"`` (``adapted_cifar`` with ``adapters``),
    ``"cifar_qat"`` (``qat_cifar``) or a torchvision model: with ``INSIDE`` in ``adapters``
    ``adapted_inside``, else ``adapted_torchvision`` (split: an input adapter, and the head
    when ``head``). ``trained`` (``adapted_inside`` only): the model trained on the
    digits, calibrated on them."""
    if trained and (model_name in ("cifar", "cifar_qat") or INSIDE not in adapters):
        raise ValueError(
            f"trained: {model_name} with adapters {', '.join(adapters)}; a trained model "
            f"is built for a torchvision model with the {INSIDE!r} adapters only"
        )
    if model_name == "cifar":
        return adapted_cifar(dtype, adapters), adapters
    if model_name == "cifar_qat":
        return qat_cifar(dtype), ("input",)
    if INSIDE in adapters:
        return adapted_inside(model_name, dtype, trained=trained), (INSIDE, "head")
    model = adapted_torchvision(model_name, dtype, head=head)
    return model, ("input", "head") if head else ("input",)


def measure(
    adapters: tuple[str, ...] = ADAPTERS,
    dtype: str = "8a8w",
    soc: str = "SM8650",
    steps: int = 3,
    lr: float | None = None,
    model_name: str = "cifar",
    head: bool = False,
    trained: bool = False,
) -> Measurement:
    """Quantize (``build``), lower for training (the context and lowering caches off),
    step ``steps`` times beside torch at ``lr`` (``quantized_backbone.LR`` of the model
    when None), and compare one step's gradients; with ``trained``, the digits model on
    batches of the digits' test split."""
    import qnn_convbwd

    model, adapters = build(model_name, dtype, adapters, head, trained)
    data = qb.batches(steps + 2, trained=trained)
    with qnn_convbwd.enabled(lowering_cache=False):
        lowered = qb.lower(model, data[0], soc)
    program = lowered.program
    rate = lr if lr is not None else qb.LR.get(model_name, qb.LR["cifar"])
    done = train_both(model, program, data[1:-1], rate)
    fused_losses = torch_losses(_reference(model, True), data[1:-1], rate)
    gradients, fused_gradients = gradient_agreements(
        program, data[-1], [_reference(model, False), _reference(model, True)]
    )
    rows = program.report.rows
    return Measurement(
        model=model_name,
        adapters=tuple(adapters),
        dtype=dtype,
        soc=soc,
        delegates=lowered.delegates,
        on_cpu=len(lowered.on_cpu),
        backward_convolutions=(sum(row.delegated for row in rows), len(rows)),
        lower_seconds=lowered.lower_seconds,
        step_seconds=[s for _, _, s in done],
        losses=[theirs for _, theirs, _ in done],
        loss_gaps=[abs(a - b) for a, b, _ in done],
        int8_bytes=sum(w.numel() for w in qb.int8_weights(model).values()),
        static_bytes=lowered.static_bytes,
        context_bytes=lowered.context_bytes,
        gradients=gradients,
        fused_loss_gaps=[abs(a - b) for (a, _, _), b in zip(done, fused_losses, strict=True)],
        fused_gradients=fused_gradients,
    )


def markdown_row(m: Measurement) -> str:
    gaps = ", ".join(f"{g:.1e}" for g in m.loss_gaps)
    losses = ", ".join(f"{v:.3f}" for v in m.losses)
    steps = ", ".join(f"{s:.2f}" for s in m.step_seconds)
    grads = ", ".join(f"{n} {c:.3f} / {r:.2f}" for n, (c, r) in m.gradients.items())
    fused_gaps = ", ".join(f"{g:.1e}" for g in m.fused_loss_gaps)
    fused_grads = ", ".join(f"{n} {c:.3f} / {r:.2f}" for n, (c, r) in m.fused_gradients.items())
    delegated, rows = m.backward_convolutions
    return (
        f"| {m.model} | {', '.join(m.adapters)} | {m.dtype} | {m.soc} | {m.delegates} | "
        f"{m.on_cpu} | {delegated} / {rows} | {m.lower_seconds:.1f} | {steps} | {losses} | "
        f"{gaps} | {m.int8_bytes:,} | {m.static_bytes:,} | {m.context_bytes:,} | {grads} | "
        f"{fused_gaps} | {fused_grads} |"
    )


MARKDOWN_HEAD = (
    "| model | trains | quantization | SoC | delegates | ops on CPU "
    "| convolution_backward delegated | lower s | step s | torch's loss per step "
    "| loss gap per step | int8 weights B | static B | context B "
    "| gradient cosine / norm ratio | loss gap, rounded once | gradient, rounded once |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)
