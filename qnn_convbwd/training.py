"""Train a lowered joint program with ExecuTorch's training runtime.

``executorch.extension.training`` loads a program whose ``to_executorch()``
emitted the ``__et_training_*`` methods (``TrainingModule``), runs
``forward_backward`` and hands the parameters and gradients to its SGD
optimizer, which updates the parameters in place. A program lowered with
this plugin keeps every trainable parameter a top-level tensor that the QNN
delegate reads at run time (``qnn_convbwd.signature``), so the optimizer's
update reaches the next step's delegate.

``TrainingSession`` keeps the program's bytes alive for as long as the loaded
module runs: the runtime reads the buffer it was loaded from (freeing it
while the module runs crashes the process).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Sequence

import torch


class WithLoss(torch.nn.Module):
    """``net`` followed by ``loss(net(x), target)``: the module a joint graph is exported
    from (``export_joint``)."""

    def __init__(self, net: torch.nn.Module, loss) -> None:
        super().__init__()
        self.net = net
        self.loss = loss

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss(self.net(x), target)


def export_joint(module: torch.nn.Module, inputs: tuple) -> torch.export.ExportedProgram:
    """``torch.export`` + ``_export_forward_backward``: the joint training graph.

    ``module(*inputs)`` returns the loss (first output); parameters with
    ``requires_grad`` are the trainable ones.
    """
    from torch.export.experimental import _export_forward_backward

    from .passes.train_mode import cumulative_average_batch_norm

    # Batch norms with momentum=None (a cumulative average) do not export as they are.
    with cumulative_average_batch_norm(module):
        exported = torch.export.export(module, inputs, strict=True)
    return _export_forward_backward(exported)


class TrainingSession:
    """A program loaded by ``TrainingModule``, with ExecuTorch's SGD optimizer."""

    def __init__(
        self,
        pte: bytes,
        lr: float,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        ptd: bytes | None = None,
    ):
        """``ptd``: the tensor data file of a program exported with external weights
        (``ExecutorchBackendConfig(external_mutable_weights=True, ...)``)."""
        from executorch.extension.pybindings.portable_lib import (
            _load_for_executorch_from_buffer,
        )
        from executorch.extension.training import TrainingModule

        # The runtime reads these buffers while the module runs: keep them alive, and
        # let the module go first (``close``; attributes are released in the order
        # they were set, so the module is set before the buffers).
        pte, ptd = bytes(pte), None if ptd is None else bytes(ptd)
        self.module = TrainingModule(_load_for_executorch_from_buffer(pte, ptd))
        self.pte, self.ptd = pte, ptd
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self._optimizer = None

    def close(self) -> None:
        """Release the loaded module, then the program's buffers (in that order)."""
        self.__dict__.pop("_optimizer", None)
        self.__dict__.pop("module", None)

    def __del__(self) -> None:
        self.close()

    def forward_backward(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """User outputs (the loss first); gradients in ``gradients()``."""
        return self.module.forward_backward("forward", list(inputs))

    def gradients(self) -> dict[str, torch.Tensor]:
        return self.module.named_gradients()

    def parameters(self) -> dict[str, torch.Tensor]:
        """The runtime's own parameter tensors (the optimizer updates these in place)."""
        return self.module.named_parameters()

    def step(self, inputs: Sequence[torch.Tensor]) -> float:
        """One forward_backward and one SGD step; returns the loss."""
        from executorch.extension.training import get_sgd_optimizer

        outputs = self.forward_backward(inputs)
        if self._optimizer is None:
            self._optimizer = get_sgd_optimizer(
                self.parameters(), self.lr, self.momentum, 0.0, self.weight_decay, False
            )
        self._optimizer.step(self.gradients())
        return float(outputs[0])


@dataclasses.dataclass
class StepRecord:
    loss: float  # the program's loss (before its update)
    reference_loss: float  # torch eager fp32, same step
    seconds: float  # wall time of the program's forward_backward + step


@dataclasses.dataclass
class TrainingRun:
    steps: list[StepRecord]
    # fqn -> (program update, torch update): theta_N - theta_0 of each trainable tensor
    updates: dict[str, tuple[torch.Tensor, torch.Tensor]]

    def update_cosine(self) -> float:
        """Cosine of the whole update vector (all trainable tensors) against torch's."""
        ours = torch.cat([u.flatten() for u, _ in self.updates.values()])
        theirs = torch.cat([r.flatten() for _, r in self.updates.values()])
        return float(torch.nn.functional.cosine_similarity(ours, theirs, dim=0))

    def update_norm_ratio(self) -> float:
        ours = torch.cat([u.flatten() for u, _ in self.updates.values()])
        theirs = torch.cat([r.flatten() for _, r in self.updates.values()])
        return float(ours.norm() / theirs.norm())

    def worst_loss_gap(self) -> float:
        """max over steps of |loss - torch loss| / max(1, |torch loss|)."""
        return max(
            abs(s.loss - s.reference_loss) / max(1.0, abs(s.reference_loss)) for s in self.steps
        )


def train_side_by_side(
    pte: bytes,
    model: torch.nn.Module,
    inputs: Sequence[torch.Tensor],
    steps: int,
    lr: float,
    on_step=None,
    ptd: bytes | None = None,
) -> TrainingRun:
    """``steps`` SGD steps of the program and of torch eager from the same weights.

    ``model(*inputs)`` returns the loss as the program does; it is copied, so
    the caller's model is untouched. ``on_step(index, record)`` is called after
    every step (progress reporting).
    """
    session = TrainingSession(pte, lr, ptd=ptd)
    reference = copy.deepcopy(model)
    trainable = {n: p for n, p in reference.named_parameters() if p.requires_grad}
    optimizer = torch.optim.SGD(list(trainable.values()), lr=lr)
    initial = {n: p.detach().clone() for n, p in trainable.items()}
    records = []
    for index in range(steps):
        start = time.perf_counter()
        loss = session.step(inputs)
        seconds = time.perf_counter() - start
        optimizer.zero_grad(set_to_none=True)
        reference_loss = reference(*inputs)
        if isinstance(reference_loss, (tuple, list)):
            reference_loss = reference_loss[0]
        reference_loss.backward()
        optimizer.step()
        record = StepRecord(loss, float(reference_loss.detach()), seconds)
        records.append(record)
        if on_step is not None:
            on_step(index, record)
    params = session.parameters()
    missing = sorted(set(trainable) - set(params))
    if missing:
        session.close()
        raise RuntimeError(f"the program does not return these trainable parameters: {missing}")
    updates = {
        name: (params[name].detach() - initial[name], trainable[name].detach() - initial[name])
        for name in trainable
    }
    del params
    session.close()
    return TrainingRun(records, updates)
