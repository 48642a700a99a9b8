"""Reference training graphs built in code, exported and with their eager reference.

The models are those of ``qnn_convbwd.commands.models`` (re-exported here):
``training_graph`` exports one with ``torch.export.experimental._export_forward_backward``
and ``TrainingGraph.reference`` computes its loss and gradients with torch autograd,
on pinned CPU kernels. ``Audio1d`` adds a 1-D stack.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from qnn_convbwd.commands.models import (  # noqa: F401  (re-exported for the tools and tests)
    BACKBONES,
    TRAINING_MODELS,
    AdapterNet,
    BasicBlock,
    CrossEntropyTraining,
    InvertedResidual,
    TrainingCase,
    adapter_case,
    cifar_case,
    demo_backbone,
    identity_adapter,
    linear_backbone,
    mobilenet_like,
    reference_model,
    resnet_like,
)


@dataclasses.dataclass
class TrainingGraph:
    name: str
    model: nn.Module  # AdapterNet or Audio1d
    inputs: tuple[torch.Tensor, torch.Tensor]
    program: torch.export.ExportedProgram  # joint forward-backward graph

    def reference(self) -> list[torch.Tensor]:
        """Loss and gradients from eager autograd, in the program's output order."""
        return autograd_reference(self.model, self.inputs, self.program)


def autograd_reference(
    model: nn.Module, inputs: tuple, joint: torch.export.ExportedProgram
) -> list[torch.Tensor]:
    """What a joint forward-backward program should output, computed by eager autograd:
    the loss and the gradients (a train() graph's buffer updates are left out).

    With torch's CPU kernels pinned (``reference_kernels.pinned``): a lowering earlier in
    the process does not change the numbers.
    """
    from .reference_kernels import pinned

    model.zero_grad(set_to_none=True)
    with pinned():
        loss = model(*inputs)
        loss.backward()
    params = dict(model.named_parameters())
    out = []
    for spec in joint.graph_signature.output_specs:
        kind = spec.kind.name
        if kind == "BUFFER_MUTATION":
            continue
        if kind == "LOSS_OUTPUT":
            out.append(loss.detach())
        elif kind == "GRADIENT_TO_PARAMETER":
            out.append(params[spec.target].grad.detach().clone())
        else:
            raise ValueError(f"unexpected output kind {kind}")
    return out


def training_graph(*args, **kwargs) -> TrainingGraph:
    """Build, export and differentiate one reference model (``reference_model``'s arguments)."""
    from torch.export.experimental import _export_forward_backward

    name, model, inputs = reference_model(*args, **kwargs)
    program = torch.export.export(model, inputs, strict=True)
    return TrainingGraph(name, model, inputs, _export_forward_backward(program))


# --- 1-D (audio-style) stacks -------------------------------------------------------


class Audio1d(nn.Module):
    """Trainable 1x1 Conv1d adapter, then a strided Conv1d and a dilated, grouped Conv1d.

    ``relu`` puts a ReLU between the two backbone convolutions; ``loss`` is
    ``"mse"`` (against the target) or ``"dot"`` (mean of output * target).
    """

    def __init__(self, trainable_backbone: bool, relu: bool = True, loss: str = "mse") -> None:
        super().__init__()
        if loss not in ("mse", "dot"):
            raise ValueError(f"loss={loss!r}")
        self.loss = loss
        self.adapter = nn.Conv1d(4, 4, 1)
        layers: list[nn.Module] = [nn.Conv1d(4, 8, 5, stride=2, padding=2)]
        if relu:
            layers.append(nn.ReLU())
        layers.append(nn.Conv1d(8, 8, 3, padding=2, dilation=2, groups=2))
        self.backbone = nn.Sequential(*layers)
        self.backbone.requires_grad_(trainable_backbone)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        y = self.backbone(self.adapter(x))
        if self.loss == "mse":
            return nn.functional.mse_loss(y, target)
        return (y * target).mean()


def audio1d_graph(
    trainable_backbone: bool = False,
    relu: bool = True,
    loss: str = "mse",
    batch: int = 2,
    length: int = 33,
    seed: int = 0,
) -> TrainingGraph:
    """Build, export and differentiate an ``Audio1d`` stack."""
    from torch.export.experimental import _export_forward_backward

    torch.manual_seed(seed)
    model = Audio1d(trainable_backbone, relu, loss)
    x = torch.randn(batch, 4, length)
    with torch.no_grad():
        target = torch.randn_like(model.backbone(model.adapter(x)))
    joint = _export_forward_backward(torch.export.export(model, (x, target), strict=True))
    name = (
        f"audio1d-{length}-{'trainable' if trainable_backbone else 'frozen'}"
        f"{'' if relu else '-linear'}-{loss}"
    )
    return TrainingGraph(name, model, (x, target), joint)
