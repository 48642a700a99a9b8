"""A pt2e-quantized frozen backbone under a float head that trains: built, lowered for
training and stepped beside torch (docs/quantized.md).

The model is ExecuTorch's CIFAR example. Its ``features`` are calibrated and converted
with executorch's ``QnnQuantizer`` (per-channel convolution weights) in one of two ways:

* ``"split"``: the backbone exported and quantized alone, the classifier a float module
  on top (``QuantizedBackbone``);
* ``"whole"``: the whole model exported and quantized with the classifier's nodes left
  unannotated (``QnnQuantizer.add_discard_nodes``), so they stay float.

The torch reference runs the same converted model in fp32 (the quantize / dequantize
pairs computed eagerly) and trains the head with ``torch.optim.SGD``.
"""

from __future__ import annotations

import copy
import dataclasses
import time

import torch
from torch import nn

BATCH = 8
SIZE = 32
CALIBRATION_BATCHES = 8
HEAD = "classifier"

# QnnQuantizer's QuantDtype member for each name measured.
DTYPES = {"8a8w": "use_8a8w", "16a8w": "use_16a8w"}
MODES = ("split", "whole")


class QuantizedBackbone(nn.Module):
    """A converted pt2e backbone (frozen) and a float head."""

    def __init__(self, backbone: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.backbone = backbone
        self.classifier = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.backbone(x), 1))


def _quantizer(dtype: str):
    from executorch.backends.qualcomm.quantizer.quantizer import QnnQuantizer, QuantDtype

    if dtype not in DTYPES:
        raise ValueError(f"unknown quantization {dtype!r}: one of {', '.join(DTYPES)}")
    quantizer = QnnQuantizer()
    quantizer.set_default_quant_config(getattr(QuantDtype, DTYPES[dtype]), is_conv_per_channel=True)
    return quantizer


def _in_head(node: torch.fx.Node) -> bool:
    stack = node.meta.get("nn_module_stack", {})
    return any(str(path).startswith(HEAD) for path, _ in stack.values())


def quantized_cifar(
    dtype: str = "8a8w", mode: str = "split", seed: int = 0, train_head: bool = False
) -> nn.Module:
    """ExecuTorch's CIFAR model (weights from ``seed``), its ``features`` quantized with
    ``dtype`` and calibrated on seeded batches, its classifier float and trainable, in
    eval() (no dropout) or with ``train_head`` in train() (dropout 0.5, split only).
    Only the classifier's parameters require a gradient."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    from qnn_convbwd import finetune

    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: one of {', '.join(MODES)}")
    net = finetune.architecture("cifar", seed=seed).eval()
    quantizer = _quantizer(dtype)
    gen = torch.Generator().manual_seed(seed)
    batches = [torch.randn(BATCH, 3, SIZE, SIZE, generator=gen) for _ in range(CALIBRATION_BATCHES)]
    if mode == "split":
        exported = torch.export.export(net.features, (batches[0],), strict=True).module()
    else:
        exported = torch.export.export(net, (batches[0],), strict=True).module()
        quantizer.add_discard_nodes([n.name for n in exported.graph.nodes if _in_head(n)])
    prepared = prepare_pt2e(exported, quantizer)
    for batch in batches:
        prepared(batch)
    converted = convert_pt2e(prepared)
    if mode == "split":
        model: nn.Module = QuantizedBackbone(converted, net.classifier.train(train_head))
    elif train_head:
        raise ValueError("train_head needs mode='split' (a converted graph has no train())")
    else:
        model = converted
    for name, parameter in model.named_parameters():
        # The converted graph keeps the float originals of the quantized weights as
        # unused attributes; only the head trains.
        parameter.requires_grad_(name.startswith(HEAD))
    return model


def batches(count: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` seeded (images, labels) batches."""
    gen = torch.Generator().manual_seed(seed)
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
            quantized = node.args[0]
            node.replace_all_uses_with(quantized.args[0])
            graph.erase_node(node)
            if not quantized.users:
                graph.erase_node(quantized)
        module.recompile()
    return result


def int8_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The converted model's int8 convolution weights (its quantized constants)."""
    return {
        name: value
        for name, value in model.named_buffers()
        if value.dtype == torch.int8 and value.dim() == 4
    }


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


@dataclasses.dataclass
class Measurement:
    mode: str
    dtype: str
    soc: str
    fp16: bool
    train_head: bool
    delegates: int
    on_cpu: int
    lower_seconds: float
    step_seconds: list[float]
    loss_gaps: list[float]
    context_bytes: int
    pte_bytes: int


def measure(
    mode: str = "split",
    dtype: str = "8a8w",
    soc: str = "SM8650",
    fp16: bool = True,
    steps: int = 3,
    lr: float = 0.05,
    train_head: bool = False,
) -> Measurement:
    """Quantize, lower for training (``training.lower_for_training``, the context and
    lowering caches off) and step ``steps`` times beside torch. With ``train_head``
    torch draws its own dropout masks: the losses are not comparable step by step."""
    import qnn_convbwd
    from qnn_convbwd import training
    from qnn_convbwd.toolchain import harness

    model = quantized_cifar(dtype, mode, train_head=train_head)
    data = batches(steps + 1)
    with qnn_convbwd.enabled(context_cache=False):
        program = training.lower_for_training(
            training.WithLoss(copy.deepcopy(model), nn.functional.cross_entropy),
            data[0],
            harness.compile_specs(soc, fp16=fp16),
        )
    steps_done = train_both(model, program, data[1:], lr)
    return Measurement(
        mode=mode,
        dtype=dtype,
        soc=soc,
        fp16=fp16,
        train_head=train_head,
        delegates=harness.delegate_count(program.edge),
        on_cpu=len(program.report.on_cpu),
        lower_seconds=program.lowering_seconds,
        step_seconds=[seconds for _, _, seconds in steps_done],
        loss_gaps=[abs(ours - theirs) for ours, theirs, _ in steps_done],
        context_bytes=sum(len(b) for b in harness.context_binaries(program.edge)),
        pte_bytes=len(program.pte),
    )


def markdown_row(m: Measurement) -> str:
    gaps = ", ".join(f"{g:.1e}" for g in m.loss_gaps)
    steps = ", ".join(f"{s:.2f}" for s in m.step_seconds)
    specs = "fp16" if m.fp16 else "fp32"
    mode = f"{m.mode}, head in train()" if m.train_head else m.mode
    return (
        f"| {mode} | {m.dtype} | {m.soc} ({specs}) | {m.delegates} | {m.on_cpu} | "
        f"{m.lower_seconds:.1f} | {steps} | {gaps} | {m.context_bytes:,} | {m.pte_bytes:,} |"
    )


MARKDOWN_HEAD = (
    "| backbone | quantization | SoC (specs) | delegates | ops on CPU | lower s | step s "
    "| loss gap per step | context B | .pte B |\n|---|---|---|---|---|---|---|---|---|---|"
)
