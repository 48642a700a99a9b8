"""A pt2e-quantized frozen backbone under a float head that trains: built, lowered for
training and stepped beside torch (docs/quantized.md).

The models (``MODELS``): ExecuTorch's CIFAR example and torchvision's resnet18 and
mobilenet_v2 (seeded random weights; the torchvision models' batch-norm running
statistics set by ``STATISTICS_PASSES`` train-mode passes over seeded random batches,
so that their activations are not vanishingly small). The backbone is everything but
the head (the child holding the last ``nn.Linear``: CIFAR's and mobilenet_v2's
``classifier``, resnet18's ``fc``), calibrated and converted with executorch's
``QnnQuantizer`` (per-channel convolution weights) in one of two ways:

* ``"split"``: the backbone exported and quantized alone, the head a float module on
  top (``qnn_convbwd.quantized.quantize_backbone``);
* ``"whole"``: the whole model exported and quantized with the head's nodes left
  unannotated (``QnnQuantizer.add_discard_nodes``), so they stay float.

The torch reference runs the same converted model in fp32 (the quantize / dequantize
pairs computed eagerly) and trains the head with ``torch.optim.SGD``.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import logging
import time
from pathlib import Path

import torch
from torch import nn

from qnn_convbwd import quantized
from qnn_convbwd.quantized import QuantizedBackbone, int8_weights  # noqa: F401

logger = logging.getLogger(__name__)

BATCH = 8
SIZE = 32
CALIBRATION_BATCHES = 8
STATISTICS_PASSES = 4
MODELS = ("cifar", "resnet18", "mobilenet_v2")
# The head's SGD learning rate per model: the torchvision heads read 512 and 1,280
# features and diverge at CIFAR's rate within three steps.
LR = {"cifar": 0.05, "resnet18": 0.01, "mobilenet_v2": 0.01}

DTYPES = quantized.SCHEMES
MODES = ("split", "whole")
# ``trained_model``'s training on the digits: 4 epochs at 0.01 take resnet18 and
# mobilenet_v2 above 95 % of the training split in eval(); 3 epochs at 0.05 leave them
# near 50 % and 70 %.
PRETRAIN_EPOCHS = 4
PRETRAIN_LR = 0.01


def trained_model(
    arch: str,
    seed: int = 0,
    epochs: int = PRETRAIN_EPOCHS,
    lr: float = PRETRAIN_LR,
    cache: str | Path | None = None,
) -> nn.Module:
    """``arch`` (weights from ``seed``) trained in fp32 on the training split of
    scikit-learn's digits at ``SIZE`` x ``SIZE`` (``finetune.digits(SIZE, seed)``) for
    ``epochs`` epochs at ``lr`` (``quantized_domain_shift.pretrain``: SGD with momentum
    0.9, batch 32, batch norms in train()), in eval(). Its state dict is kept in ``cache`` (default
    ``<qnn_convbwd cache>/digits_models``) and read from there when present."""
    from qnn_convbwd import finetune
    from qnn_convbwd.toolchain.sdk import cache_dir

    from .quantized_domain_shift import pretrain

    folder = Path(cache) if cache is not None else cache_dir() / "digits_models"
    path = folder / f"{arch}-seed{seed}-epochs{epochs}-lr{lr:g}.pt"
    if path.exists():
        net = finetune.architecture(arch, seed=seed)
        try:
            net.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        except Exception as err:  # a truncated or foreign file
            raise ValueError(
                f"{path}: not a checkpoint of {arch} ({type(err).__name__}: {err}); "
                "delete it to train again"
            ) from None
        return net.eval()
    net = pretrain(finetune.digits(SIZE, seed), arch, epochs=epochs, lr=lr, seed=seed)
    folder.mkdir(parents=True, exist_ok=True)
    finetune.save_atomic(path, net.state_dict())
    logger.info("%s trained on the digits: %s", arch, path)
    return net


def float_model(arch: str = "cifar", seed: int = 0, trained: bool = False) -> nn.Module:
    """``arch`` with weights from ``seed``, in ``eval()``; a model with batch norms gets
    their running statistics from ``STATISTICS_PASSES`` train-mode passes over seeded
    random batches (cumulative averages). With ``trained``: ``trained_model(arch,
    seed)``."""
    from qnn_convbwd import finetune

    if arch not in MODELS:
        raise ValueError(f"unknown model {arch!r}: one of {', '.join(MODELS)}")
    if trained:
        return trained_model(arch, seed)
    net = finetune.architecture(arch, seed=seed)
    norms = [m for m in net.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if norms:
        for norm in norms:
            norm.reset_running_stats()
            norm.momentum = None
        gen = torch.Generator().manual_seed(seed + 1000)
        net.train()
        with torch.no_grad():
            for _ in range(STATISTICS_PASSES):
                net(torch.randn(BATCH, 3, SIZE, SIZE, generator=gen))
        for norm in norms:
            norm.momentum = 0.1
    return net.eval()


def _head(net: nn.Module) -> str:
    from qnn_convbwd import finetune

    return quantized.head_child(net, finetune.head(net))


def calibration_batches(seed: int = 0, trained: bool = False) -> list[torch.Tensor]:
    """``CALIBRATION_BATCHES`` seeded random batches; with ``trained``, batches of the
    digits' training split (``finetune.calibration_data``), what ``trained_model``
    learnt from."""
    from qnn_convbwd import finetune

    if trained:
        split = finetune.digits(SIZE, seed)
        return finetune.calibration_data(split.train, BATCH, CALIBRATION_BATCHES, seed)[0]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(BATCH, 3, SIZE, SIZE, generator=gen) for _ in range(CALIBRATION_BATCHES)]


def quantized_model(
    arch: str = "cifar",
    dtype: str = "8a8w",
    mode: str = "split",
    seed: int = 0,
    train_head: bool = False,
    trained: bool = False,
) -> nn.Module:
    """``float_model(arch, seed, trained)``, its backbone quantized with ``dtype`` and
    calibrated on ``calibration_batches(seed, trained)``, its head float and trainable, in
    eval() (no dropout) or with ``train_head`` in train() (split only). Only the head's
    parameters require a gradient."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    from qnn_convbwd import finetune

    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: one of {', '.join(MODES)}")
    net = float_model(arch, seed, trained)
    top = _head(net)
    batches = calibration_batches(seed, trained)
    if mode == "split":
        model = quantized.quantize_backbone(net, finetune.head(net), dtype, batches)
        return model.train(train_head)
    if train_head:
        raise ValueError("train_head needs mode='split' (a converted graph has no train())")
    quantizer = quantized.quantizer(dtype)
    exported = torch.export.export(net, (batches[0],), strict=True).module()
    quantizer.add_discard_nodes([n.name for n in exported.graph.nodes if _in_head(n, top)])
    prepared = prepare_pt2e(exported, quantizer)
    for batch in batches:
        prepared(batch)
    model = convert_pt2e(prepared)
    for name, parameter in model.named_parameters():
        # The converted graph keeps the float originals of the quantized weights as
        # unused attributes; only the head trains.
        parameter.requires_grad_(name.startswith(top))
    return model


def quantized_cifar(
    dtype: str = "8a8w", mode: str = "split", seed: int = 0, train_head: bool = False
) -> nn.Module:
    """``quantized_model("cifar", ...)``: ExecuTorch's CIFAR model, its ``classifier``
    the head."""
    return quantized_model("cifar", dtype, mode, seed, train_head)


def float_split(arch: str = "cifar", seed: int = 0, trained: bool = False) -> nn.Module:
    """The same model unquantized (``float_model``), its head alone trainable: what the
    quantized program is compared with for its weight bytes."""
    net = float_model(arch, seed, trained)
    top = _head(net)
    for name, parameter in net.named_parameters():
        parameter.requires_grad_(name.startswith(top + "."))
    return net


def _in_head(node: torch.fx.Node, top: str) -> bool:
    stack = node.meta.get("nn_module_stack", {})
    return any(str(path).startswith(top) for path, _ in stack.values())


def batches(
    count: int, seed: int = 1, trained: bool = False
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` seeded random (images, labels) batches; with ``trained``, batches of the
    digits' test split (``finetune.digits(SIZE)``, unseen by ``trained_model``) drawn by
    a permutation from ``seed``."""
    from qnn_convbwd import finetune

    gen = torch.Generator().manual_seed(seed)
    if trained:
        x, y = finetune.digits(SIZE).test
        if count * BATCH > len(y):
            raise ValueError(f"{count} batches of {BATCH}: the digits' test split has {len(y)}")
        order = torch.randperm(len(y), generator=gen)[: count * BATCH].view(count, BATCH)
        return [(x[index], y[index]) for index in order]
    return [
        (
            torch.randn(BATCH, 3, SIZE, SIZE, generator=gen),
            torch.randint(0, 10, (BATCH,), generator=gen),
        )
        for _ in range(count)
    ]


def without_activation_quantization(model: nn.Module) -> nn.Module:
    """A copy of a ``quantized_cifar`` model whose activations are not quantized: every
    per-tensor quantize / dequantize pair of its converted graph removed (the weights'
    per-channel dequantizes stay). What a CPU program computes after executorch's
    FoldQDQ folded the pairs."""
    result = copy.deepcopy(model)
    dequantize = torch.ops.quantized_decomposed.dequantize_per_tensor.default
    quantize = torch.ops.quantized_decomposed.quantize_per_tensor.default
    for module in result.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        graph = module.graph
        for node in list(graph.nodes):
            if node.target != dequantize or node.args[0].target != quantize:
                continue
            quantize_node = node.args[0]
            node.replace_all_uses_with(quantize_node.args[0])
            graph.erase_node(node)
            if not quantize_node.users:
                graph.erase_node(quantize_node)
        module.recompile()
    return result


# Ops the HTP applies to a convolution's (or an add's) result before requantizing it:
# QNN computes the pair with one rounding, to the activation's quantization.
_FUSED_ACTIVATIONS = {
    torch.ops.aten.relu.default,
    torch.ops.aten.relu_.default,
    torch.ops.aten.hardtanh.default,
    torch.ops.aten.hardtanh_.default,
}
_FUSED_PRODUCERS = {
    torch.ops.aten.conv2d.default,
    torch.ops.aten.add.Tensor,
    torch.ops.aten.add_.Tensor,
}


def fused_activations(model: nn.Module) -> nn.Module:
    """A copy of a quantized model whose convolutions and adds feed their ReLU / ReLU6
    (``hardtanh``) without the quantize / dequantize pair between them: the result
    rounded once, to the activation's quantization, not first to the convolution's."""
    result = copy.deepcopy(model)
    dequantize = torch.ops.quantized_decomposed.dequantize_per_tensor.default
    quantize = torch.ops.quantized_decomposed.quantize_per_tensor.default
    for module in result.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        graph = module.graph
        for node in list(graph.nodes):
            if node.target not in _FUSED_ACTIVATIONS:
                continue
            dq = node.args[0]
            if not isinstance(dq, torch.fx.Node) or dq.target != dequantize:
                continue
            q = dq.args[0]
            if q.target != quantize or q.args[0].target not in _FUSED_PRODUCERS:
                continue
            if len(dq.users) != 1 or len(q.users) != 1:
                continue
            node.replace_input_with(dq, q.args[0])
            graph.erase_node(dq)
            graph.erase_node(q)
        module.recompile()
    return result


def train_both(
    model: nn.Module, program, data: list, lr: float
) -> list[tuple[float, float, float]]:
    """(program loss, torch loss, the program step's wall seconds) per SGD step at
    ``lr``, from the same weights and batches ``data``; the program through
    ``program.session``."""
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=lr)
    session = program.session(lr)
    steps = []
    try:
        for x, y in data:
            start = time.perf_counter()
            ours = session.step([x, y])
            seconds = time.perf_counter() - start
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(reference(x), y)
            loss.backward()
            optimizer.step()
            steps.append((ours, loss.item(), seconds))
    finally:
        session.close()
    return steps


def static_bytes(graphs: list) -> int:
    """Bytes of the static tensors (weights, biases, constants) of the captured QNN
    graphs (``integration.capture_qnn_graphs``), each tensor counted once."""
    seen: dict[str, int] = {}
    for ops in graphs:
        for op in ops:
            for tensor in op.inputs:
                if tensor.is_static:
                    seen[tensor.name] = tensor.nbytes
    return sum(seen.values())


@dataclasses.dataclass
class Lowered:
    program: object
    delegates: int
    on_cpu: list  # qnn_convbwd.CpuOp of every op kept on CPU
    lower_seconds: float
    static_bytes: int
    context_bytes: int
    qnn_ops: collections.Counter


def lower(model: nn.Module, example: tuple, soc: str, fp16: bool = True) -> Lowered:
    """``model`` under a cross-entropy loss lowered for training for ``soc``
    (``training.lower_for_training``, the context and lowering caches off), the QNN
    graphs captured."""
    import qnn_convbwd
    from qnn_convbwd import integration, training
    from qnn_convbwd.toolchain import harness

    with qnn_convbwd.enabled(context_cache=False), integration.capture_qnn_graphs() as graphs:
        program = training.lower_for_training(
            training.WithLoss(copy.deepcopy(model), nn.functional.cross_entropy),
            example,
            harness.compile_specs(soc, fp16=fp16),
        )
    graphs = [list(g) for g in graphs]
    return Lowered(
        program=program,
        delegates=harness.delegate_count(program.edge),
        on_cpu=list(program.report.on_cpu),
        lower_seconds=program.lowering_seconds,
        static_bytes=static_bytes(graphs),
        context_bytes=sum(len(b) for b in harness.context_binaries(program.edge)),
        qnn_ops=collections.Counter(op.op_type for ops in graphs for op in ops),
    )


@dataclasses.dataclass
class Measurement:
    arch: str
    mode: str
    dtype: str
    soc: str
    fp16: bool
    train_head: bool
    delegates: int
    on_cpu: dict[str, int]  # ops kept on CPU by rule
    on_cpu_details: list[str]  # each such op: node, rule, reason
    lower_seconds: float
    step_seconds: list[float]
    losses: list[float]  # torch's
    loss_gaps: list[float]
    context_bytes: int
    pte_bytes: int
    static_bytes: int  # the quantized program's static QNN tensors
    int8_weight_bytes: int  # the converted model's int8 convolution weights
    qnn_ops: dict[str, int]
    float_static_bytes: int | None = None  # the fp16 program of the same model unquantized
    float_context_bytes: int | None = None
    float_lower_seconds: float | None = None
    # |torch's loss on the converted model - torch's on the float model|, first batch,
    # before training: the size of the quantization's own effect on the loss.
    quantization_loss_gap: float | None = None
    trained: bool = False  # the model trained on the digits, stepped on digits

    @property
    def within_bound(self) -> bool:
        """Every step's loss gap within 3e-2 * max(1, |torch's loss|)."""
        return all(g <= 3e-2 * max(1.0, abs(t)) for g, t in zip(self.loss_gaps, self.losses))


def measure(
    arch: str = "cifar",
    mode: str = "split",
    dtype: str = "8a8w",
    soc: str = "SM8650",
    fp16: bool = True,
    steps: int = 3,
    lr: float | None = None,
    train_head: bool = False,
    compare_float: bool = False,
    trained: bool = False,
) -> Measurement:
    """Quantize, lower for training (the context and lowering caches off) and step
    ``steps`` times beside torch; with ``compare_float`` also lower the same model
    unquantized (``float_split``) for its static and context bytes. With ``train_head``
    torch draws its own dropout masks: the losses are not comparable step by step. With
    ``trained``: the model trained on the digits (``trained_model``), calibrated on the
    digits' training split and stepped on batches of its test split."""
    model = quantized_model(arch, dtype, mode, train_head=train_head, trained=trained)
    data = batches(steps + 1, trained=trained)
    lowered = lower(model, data[0], soc, fp16)
    steps_done = train_both(model, lowered.program, data[1:], lr or LR[arch])
    measured = Measurement(
        arch=arch,
        mode=mode,
        dtype=dtype,
        soc=soc,
        fp16=fp16,
        train_head=train_head,
        delegates=lowered.delegates,
        on_cpu=dict(collections.Counter(op.rule for op in lowered.on_cpu).most_common()),
        on_cpu_details=[str(op) for op in lowered.on_cpu],
        lower_seconds=lowered.lower_seconds,
        step_seconds=[seconds for _, _, seconds in steps_done],
        losses=[theirs for _, theirs, _ in steps_done],
        loss_gaps=[abs(ours - theirs) for ours, theirs, _ in steps_done],
        context_bytes=lowered.context_bytes,
        pte_bytes=len(lowered.program.pte),
        static_bytes=lowered.static_bytes,
        int8_weight_bytes=sum(w.numel() for w in int8_weights(model).values()),
        qnn_ops=dict(lowered.qnn_ops.most_common()),
        trained=trained,
    )
    del lowered
    if mode == "split" and not train_head:
        x, y = data[1]
        with torch.no_grad():
            unquantized = nn.functional.cross_entropy(float_model(arch, 0, trained)(x), y).item()
            converted = nn.functional.cross_entropy(model(x), y).item()
        measured.quantization_loss_gap = abs(converted - unquantized)
    if compare_float:
        reference = lower(float_split(arch, 0, trained), data[0], soc, fp16)
        measured.float_static_bytes = reference.static_bytes
        measured.float_context_bytes = reference.context_bytes
        measured.float_lower_seconds = reference.lower_seconds
    return measured


def _bytes(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def markdown_row(m: Measurement) -> str:
    gaps = ", ".join(f"{g:.1e}" for g in m.loss_gaps)
    steps = ", ".join(f"{s:.2f}" for s in m.step_seconds)
    specs = "fp16" if m.fp16 else "fp32"
    mode = f"{m.mode}, head in train()" if m.train_head else m.mode
    arch = f"{m.arch} (trained on digits)" if m.trained else m.arch
    on_cpu = ", ".join(f"{rule} {count}" for rule, count in m.on_cpu.items()) or "0"
    return (
        f"| {arch} | {mode} | {m.dtype} | {m.soc} ({specs}) | {m.delegates} | {on_cpu} | "
        f"{m.lower_seconds:.1f} | {steps} | {gaps} | {m.int8_weight_bytes:,} | "
        f"{m.static_bytes:,} | {_bytes(m.float_static_bytes)} | {m.context_bytes:,} | "
        f"{_bytes(m.float_context_bytes)} | {m.pte_bytes:,} |"
    )


MARKDOWN_HEAD = (
    "| model | backbone | quantization | SoC (specs) | delegates | ops on CPU | lower s "
    "| step s | loss gap per step | int8 weights B | static B | fp16 static B | context B "
    "| fp16 context B | .pte B |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def _blocks(arch: str, net: nn.Module) -> list[nn.Module]:
    """The backbone's blocks in order, before its pooling."""
    if arch == "resnet18":
        return [m for name, m in net.named_children() if name not in ("avgpool", "fc")]
    return list(net.features)


@dataclasses.dataclass
class ForwardGap:
    arch: str
    dtype: str
    blocks: int  # the backbone's first blocks lowered
    program_vs_torch: float  # relative L2 error of the program's output, torch's converted
    program_vs_fused: float  # the same against ``fused_activations`` of the converted
    torch_vs_float: float  # torch's converted against the float blocks: quantization
    program_vs_float: float  # the program's against the float blocks


def _converted_blocks(
    arch: str, dtype: str, blocks: int | None, trained: bool
) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    """(the float blocks, the same converted, an input batch): the first ``blocks`` blocks
    of ``arch``'s backbone (all when ``None``) quantized with ``dtype`` and calibrated as
    ``quantized_model`` does (``trained``: the digits model on digits)."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    net = float_model(arch, trained=trained)
    part = nn.Sequential(*_blocks(arch, net)[:blocks]).eval()
    calibration = calibration_batches(trained=trained)
    exported = torch.export.export(part, (calibration[0],), strict=True).module()
    prepared = prepare_pt2e(exported, quantized.quantizer(dtype))
    for batch in calibration:
        prepared(batch)
    return part, convert_pt2e(prepared), batches(2, trained=trained)[1][0]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def quantization_error(
    arch: str, dtype: str = "8a8w", blocks: int | None = None, trained: bool = False
) -> float:
    """Torch alone: the relative L2 error of the converted blocks' output (the features)
    against the float blocks' on one batch (``_converted_blocks``); ``forward_gap``'s
    ``torch_vs_float`` without lowering."""
    part, converted, x = _converted_blocks(arch, dtype, blocks, trained)
    with torch.no_grad():
        return _relative(converted(x), part(x))


def forward_gap(
    arch: str, dtype: str = "8a8w", blocks: int | None = None, trained: bool = False
) -> ForwardGap:
    """The first ``blocks`` blocks of ``arch``'s backbone (all when ``None``), quantized
    and calibrated as ``quantized_model`` does, lowered alone for inference on SM8650 and
    run on one seeded batch; relative L2 errors of the outputs (the features)."""
    import qnn_convbwd
    from qnn_convbwd.toolchain import harness

    part, converted, x = _converted_blocks(arch, dtype, blocks, trained)
    with qnn_convbwd.enabled(context_cache=False):
        compiled = harness.lower_module(copy.deepcopy(converted), (x,), "SM8650")
    ours = compiled.run([x])[0]
    with torch.no_grad():
        theirs, fused, unquantized = converted(x), fused_activations(converted)(x), part(x)
    return ForwardGap(
        arch,
        dtype,
        len(part),
        _relative(ours, theirs),
        _relative(ours, fused),
        _relative(theirs, unquantized),
        _relative(ours, unquantized),
    )
