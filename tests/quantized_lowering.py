"""A quantized model lowered for training with its QNN graphs captured, and its steps
beside torch's: shared by the quantized-backbone and straight-through tests."""

from __future__ import annotations

import copy
from collections.abc import Callable

from torch import nn


def lowered_with_graphs(model: nn.Module, soc: str):
    """(model as lowered, the program, the QNN graphs built) of ``model`` for ``soc``."""
    from qnn_convbwd import integration, training
    from qnn_convbwd.toolchain import harness
    from qnn_convbwd_dev import quantized_backbone as qb

    with integration.capture_qnn_graphs() as graphs:
        program = training.lower_for_training(
            training.WithLoss(copy.deepcopy(model), nn.functional.cross_entropy),
            qb.batches(1)[0],
            harness.compile_specs(soc),
        )
    return model, program, [list(g) for g in graphs]


def assert_losses_follow_torch(
    model: nn.Module, program, steps: int, lr: float, train_both: Callable
) -> None:
    """Each of ``steps`` SGD steps' loss within 3e-2 * max(1, |loss|) of torch's, as
    ``train_both`` (the model's own or its straight-through reference) trains it."""
    from qnn_convbwd_dev import quantized_backbone as qb

    found = train_both(model, program, qb.batches(steps + 1)[1:], lr)
    for step, (ours, theirs, _) in enumerate(found):
        bound = 3e-2 * max(1.0, abs(theirs))
        assert abs(ours - theirs) <= bound, f"step {step}: {ours} vs torch {theirs} (> {bound})"
