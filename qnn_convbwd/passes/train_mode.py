"""Train-mode batch norm as core ATen ops, before executorch decomposes the graph
(``prepare`` first rewrites train-mode dropout: ``passes/dropout.py``).

A joint graph of a model in ``train()`` normalises with the batch's statistics
(``aten._native_batch_norm_legit_functional``, or ``aten._native_batch_norm_legit.no_stats``
when ``track_running_stats=False``) and returns the next running statistics as
buffer mutations. executorch 1.5.1 accepts neither op (not core ATen), on any
backend. ``prepare`` rewrites them with ``ExportedProgram.run_decompositions`` into
ops every backend has, keeping the program's signature (the buffer mutations, the
loss and the gradients) as it was:

* batch statistics in the stable two-pass form: ``mean = mean(x)``,
  ``d = x - mean``, ``var = mean(d * d)`` (biased, as torch normalises), then
  ``out = d * rsqrt(var + eps) * w + b``. One-pass ``E[x^2] - E[x]^2`` cancels
  catastrophically in fp16 when ``|mean| >> std``; the centred square does not;
* the running statistics ``(1 - m) * r + m * s``, with the unbiased variance
  ``var * n / (n - 1)`` as torch keeps it. These nodes only compute the next value
  of a buffer, so the partition rules keep them in fp32 on the CPU
  (``partition/judge.py``, ``program_state_on_cpu``); the batch statistics they read
  come from the delegate.

The batch norm's backward in the joint graph is already decomposed by autograd
and reads the statistics this returns (``mean`` and ``rsqrt(var + eps)``).

``momentum=None`` (a cumulative average, ``1 / num_batches_tracked``) does not
export: torch.export cannot trace ``1 / float(num_batches_tracked)``.
``cumulative_average_batch_norm`` stands in for those modules while
``training.export_joint`` exports them.
"""

from __future__ import annotations

import contextlib
import logging
import types
from collections.abc import Iterator

import torch

from . import dropout

logger = logging.getLogger(__name__)

aten = torch.ops.aten


def _reduced_dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _channel_shape(x: torch.Tensor) -> list[int]:
    return [1, x.shape[1], *([1] * (x.dim() - 2))]


def _normalise(x, weight, bias, eps):
    """``(x - mean) * rsqrt(var + eps) * w + b`` with the batch's biased variance;
    returns the output and the per-channel ``mean``, ``var`` and ``rsqrt(var + eps)``."""
    dims = _reduced_dims(x)
    mean = aten.mean.dim(x, dims, True)
    centred = aten.sub.Tensor(x, mean)
    var = aten.mean.dim(aten.mul.Tensor(centred, centred), dims, True)
    rstd = aten.rsqrt.default(aten.add.Tensor(var, eps))
    out = aten.mul.Tensor(centred, rstd)
    shape = _channel_shape(x)
    if weight is not None:
        out = aten.mul.Tensor(out, aten.view.default(weight, shape))
    if bias is not None:
        out = aten.add.Tensor(out, aten.view.default(bias, shape))
    channels = [x.shape[1]]
    return (
        out,
        aten.view.default(mean, channels),
        aten.view.default(var, channels),
        aten.view.default(rstd, channels),
    )


def _moving_average(running, batch, momentum: float):
    """``(1 - m) * running + m * batch``; at ``m == 1`` the batch alone (the buffer's
    old value is not read, as torch's own arithmetic gives it)."""
    if momentum == 1.0:
        return aten.clone.default(batch)
    return aten.add.Tensor(
        aten.mul.Tensor(running, 1.0 - momentum), aten.mul.Tensor(batch, momentum)
    )


def batch_norm_with_statistics(x, weight, bias, running_mean, running_var, training, momentum, eps):
    """``aten._native_batch_norm_legit_functional``: output, the batch's mean and
    ``rsqrt(var + eps)``, and the next running mean and (unbiased) variance."""
    if not training:
        # Normalises with the running statistics and leaves them as they are.
        shape = _channel_shape(x)
        rstd = aten.rsqrt.default(aten.add.Tensor(running_var, eps))
        out = aten.mul.Tensor(
            aten.sub.Tensor(x, aten.view.default(running_mean, shape)),
            aten.view.default(rstd, shape),
        )
        if weight is not None:
            out = aten.mul.Tensor(out, aten.view.default(weight, shape))
        if bias is not None:
            out = aten.add.Tensor(out, aten.view.default(bias, shape))
        empty = aten.new_zeros.default(x, [0])
        return (
            out,
            empty,
            empty,
            aten.clone.default(running_mean),
            aten.clone.default(running_var),
        )
    out, mean, var, rstd = _normalise(x, weight, bias, eps)
    count = x.numel() // x.shape[1]
    # torch divides by n - 1 for the running variance (n = 1 gives inf, as torch does).
    unbiased = aten.mul.Tensor(var, count / (count - 1) if count > 1 else float("inf"))
    return (
        out,
        mean,
        rstd,
        _moving_average(running_mean, mean, momentum),
        _moving_average(running_var, unbiased, momentum),
    )


def batch_norm_without_statistics(x, weight, bias, training, momentum, eps):
    """``aten._native_batch_norm_legit.no_stats`` (``track_running_stats=False``)."""
    out, mean, _, rstd = _normalise(x, weight, bias, eps)
    return out, mean, rstd


def decompositions() -> dict:
    """The train-mode batch-norm ops this module rewrites, with their rewrites."""
    return {
        aten._native_batch_norm_legit_functional.default: batch_norm_with_statistics,
        aten._native_batch_norm_legit.no_stats: batch_norm_without_statistics,
    }


# Ops of a program not yet in core ATen (``torch.export.export``'s training IR)
# that become ``_native_batch_norm_legit_functional`` in train mode, with the index
# of their ``training`` argument (None: always train mode).
_TRAINING_IR = {
    aten.batch_norm.default: 5,
    aten._batch_norm_with_update.default: None,
    aten._batch_norm_with_update_functional.default: None,
    aten._native_batch_norm_legit.default: 5,
    aten.native_batch_norm.default: 5,
}


def _is_train_mode(node: torch.fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target in decompositions():
        return True
    if node.target not in _TRAINING_IR:
        return False
    index = _TRAINING_IR[node.target]
    return index is None or bool(node.args[index] if len(node.args) > index else False)


def train_mode_nodes(program: torch.export.ExportedProgram) -> list[torch.fx.Node]:
    """The program's nodes ``prepare`` rewrites: train-mode batch norms, in core ATen
    (a joint graph) or in the training IR ``torch.export.export`` gives."""
    return [n for n in program.graph.nodes if _is_train_mode(n)]


def prepare(
    program: torch.export.ExportedProgram, dropout_seed: int | None = None
) -> torch.export.ExportedProgram:
    """``program`` with its train-mode dropout draws rewritten (``passes.dropout``, keys
    from ``dropout_seed``) and its train-mode batch norms decomposed (itself when it
    has neither).

    Runs on the ATen program, before executorch's own decompositions
    (``QnnPartitioner.transform_for_pre_decomposition``, and ``qnn_convbwd.lower``).
    """
    program, _ = dropout.rewrite(program, dropout_seed)
    found = train_mode_nodes(program)
    if not found:
        return program
    logger.info(
        "train-mode batch norm: %d nodes as batch statistics and running-statistic updates",
        len(found),
    )
    return program.run_decompositions(decompositions())


# --- momentum=None ------------------------------------------------------------------


def _cumulative_forward(self, x: torch.Tensor) -> torch.Tensor:
    """A batch norm with ``momentum=None`` in train mode, in a form torch.export traces:
    normalised with the batch's statistics (the two-pass form above), and the running
    statistics moved by ``1 / num_batches_tracked`` as tensor arithmetic."""
    self._check_input_dim(x)
    dims, shape = _reduced_dims(x), _channel_shape(x)
    mean = x.mean(dims, keepdim=True)
    centred = x - mean
    var = (centred * centred).mean(dims, keepdim=True)
    out = centred * torch.rsqrt(var + self.eps)
    if self.weight is not None:
        out = out * self.weight.view(shape)
    if self.bias is not None:
        out = out + self.bias.view(shape)
    count = x.numel() // x.shape[1]
    with torch.no_grad():
        self.num_batches_tracked.add_(1)
        factor = 1.0 / self.num_batches_tracked.to(x.dtype)
        unbiased = var.flatten() * (count / max(count - 1, 1))
        self.running_mean.add_((mean.flatten() - self.running_mean) * factor)
        self.running_var.add_((unbiased - self.running_var) * factor)
    return out


def _is_cumulative(module: torch.nn.Module) -> bool:
    return (
        isinstance(module, torch.nn.modules.batchnorm._BatchNorm)
        and module.momentum is None
        and module.training
        and module.track_running_stats
    )


@contextlib.contextmanager
def cumulative_average_batch_norm(model: torch.nn.Module) -> Iterator[int]:
    """While exporting: batch norms with ``momentum=None`` in train mode run
    ``_cumulative_forward`` (yields how many). Their running statistics then follow
    torch's cumulative average exactly; the normalisation is the same."""
    replaced = [m for m in model.modules() if _is_cumulative(m)]
    for module in replaced:
        module.forward = types.MethodType(_cumulative_forward, module)
    try:
        yield len(replaced)
    finally:
        for module in replaced:
            del module.forward
