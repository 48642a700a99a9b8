"""A classifier's backbone quantized with executorch's ``QnnQuantizer`` (pt2e), its head
left float: the model whose head trains through a frozen quantized backbone
(docs/quantized.md).

``quantize_backbone`` splits a classifier at its head (the top-level child holding the
layer that gives the classes), exports the rest in ``eval()`` (batch norms then fold
into the convolutions in ``prepare_pt2e``), calibrates it on the batches given and
converts it (``convert_pt2e``): convolution weights int8 per output channel,
activations 8 or 16 bits per tensor. The head is the float module itself, and its
parameters alone require a gradient.
"""

from __future__ import annotations

import copy
import hashlib
import logging
from collections.abc import Iterable

import torch
from torch import nn

logger = logging.getLogger(__name__)

# QnnQuantizer's QuantDtype member for each quantization offered.
SCHEMES = {"8a8w": "use_8a8w", "16a8w": "use_16a8w"}
# The largest batch the quantized backbone takes.
BATCH_LIMIT = 4096


class QuantizationError(ValueError):
    """A model that cannot be split or quantized; the message says which and why."""


class QuantizedBackbone(nn.Module):
    """``head(flatten(backbone(x), 1))``: a converted pt2e backbone, frozen, and the float
    head under the attribute the original model gave it (``head_name``).

    ``train()`` / ``eval()`` set the head's mode alone: the converted backbone computes
    as the model did in ``eval()`` (its batch norms folded), whatever the mode."""

    def __init__(self, backbone: nn.Module, head: nn.Module, head_name: str) -> None:
        super().__init__()
        self.backbone = backbone
        self.head_name = head_name
        setattr(self, head_name, head)

    @property
    def head(self) -> nn.Module:
        return getattr(self, self.head_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.backbone(x), 1))

    def train(self, mode: bool = True) -> QuantizedBackbone:
        self.training = mode
        self.head.train(mode)
        return self


def quantizer(scheme: str):
    """executorch's ``QnnQuantizer`` for ``scheme`` (``SCHEMES``), convolution weights per
    output channel."""
    from executorch.backends.qualcomm.quantizer.quantizer import QnnQuantizer, QuantDtype

    if scheme not in SCHEMES:
        raise QuantizationError(f"quantization {scheme!r}: one of {', '.join(SCHEMES)}")
    chosen = QnnQuantizer()
    chosen.set_default_quant_config(getattr(QuantDtype, SCHEMES[scheme]), is_conv_per_channel=True)
    return chosen


def head_child(net: nn.Module, head: str) -> str:
    """The top-level child of ``net`` that holds the module named ``head`` (the layer
    giving the classes): ``fc`` for a ResNet, ``classifier`` for MobileNetV2 or the
    CIFAR example. The model's forward must end with it, after a flatten."""
    top = head.split(".", 1)[0]
    if top not in dict(net.named_children()):
        raise QuantizationError(f"{type(net).__name__}: no child {top!r} holding the head {head!r}")
    return top


def backbone_of(net: nn.Module, top: str) -> nn.Module:
    """A copy of ``net`` whose child ``top`` (the head) is ``nn.Identity``: the backbone,
    computing the features the head reads."""
    backbone = copy.deepcopy(net)
    setattr(backbone, top, nn.Identity())
    return backbone


def quantize_backbone(
    net: nn.Module, head: str, scheme: str, calibration: Iterable[torch.Tensor]
) -> QuantizedBackbone:
    """``net``'s backbone quantized with ``scheme`` after calibration on the input batches
    ``calibration`` (all of one shape), under a copy of its float head (the child of
    ``net`` holding the module named ``head``; ``head_child``). Only the head's
    parameters require a gradient; the head keeps ``net``'s mode, the backbone
    computes as in ``eval()``. ``net`` is left as it was."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    top = head_child(net, head)
    batches = list(calibration)
    if not batches:
        raise QuantizationError("no calibration batch: the backbone cannot be quantized")
    backbone = backbone_of(net, top).eval()
    chosen = quantizer(scheme)
    with torch.no_grad():
        try:
            # Any batch size: the program's is fixed when it is lowered, an evaluation's
            # or an inference program's may be another.
            exported = torch.export.export(
                backbone,
                (batches[0],),
                dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=BATCH_LIMIT)},),
                strict=True,
            ).module()
        except Exception as err:  # whatever torch.export raises on the model
            raise QuantizationError(
                f"{type(net).__name__}: its backbone (without {top!r}) does not export "
                f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
            ) from None
        prepared = prepare_pt2e(exported, chosen)
        for batch in batches:
            prepared(batch)
        converted = convert_pt2e(prepared)
    _drop_unread_state(converted)
    model = QuantizedBackbone(converted, copy.deepcopy(getattr(net, top)), top)
    model.train(net.training)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name.startswith(top + "."))  # only the head trains
    logger.info(
        "quantized %s's backbone (%s) on %d calibration batch(es)",
        type(net).__name__,
        scheme,
        len(batches),
    )
    return model


def _drop_unread_state(module: torch.fx.GraphModule) -> None:
    """Delete the parameters and buffers ``module``'s graph does not read: the float
    originals of the weights ``convert_pt2e`` quantized, which it keeps as attributes.
    The module's state is then what a program lowered from it holds."""
    read = {str(n.target) for n in module.graph.nodes if n.op == "get_attr"}
    unread = [
        name
        for name, _ in [*module.named_parameters(), *module.named_buffers()]
        if name not in read
    ]
    for name in unread:
        owner, _, attribute = name.rpartition(".")
        delattr(module.get_submodule(owner) if owner else module, attribute)


def int8_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The converted model's int8 convolution weights (its quantized constants)."""
    return {
        name: value
        for name, value in model.named_buffers()
        if value.dtype == torch.int8 and value.dim() == 4
    }


def digest(model: QuantizedBackbone) -> str:
    """SHA-256 of the converted backbone: its graph's code (the activations' scales and
    zero points are literals there) and every tensor it holds. Two quantizations of the
    same weights on the same calibration batches have the same digest."""
    hashed = hashlib.sha256(model.backbone.code.encode())
    for name, value in sorted(model.backbone.state_dict().items()):
        hashed.update(name.encode())
        hashed.update(value.detach().contiguous().view(torch.uint8).numpy().tobytes())
    for name, value in sorted(_tensor_attributes(model.backbone).items()):
        hashed.update(name.encode())
        hashed.update(value.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return hashed.hexdigest()


def _tensor_attributes(module: nn.Module) -> dict[str, torch.Tensor]:
    """Tensors the graph reads as plain attributes (``get_attr`` targets that are neither
    parameters nor buffers)."""
    found: dict[str, torch.Tensor] = {}
    if not isinstance(module, torch.fx.GraphModule):
        return found
    for node in module.graph.nodes:
        if node.op != "get_attr":
            continue
        value = module
        for part in str(node.target).split("."):
            value = getattr(value, part)
        if isinstance(value, torch.Tensor):
            found[str(node.target)] = value
    return found
