"""Eval-mode batch norm folded into the frozen convolution that feeds it.

On the HTP a batch norm after a convolution costs precision: as
``passes.batch_norm`` lowers it, ``(x - mean) * scale + b`` is three fp16
element-wise ops after the convolution's own rounding, and across a network the
excess adds up (MobileNetV3-Small's logits at 32 px: 2.5x torch fp16's error;
with every pair folded on the host 0.95x, docs/zoo.md). When the convolution's
weight, its bias and the batch norm's weight are frozen, the pair is one
convolution with

* weight ``W * s`` per output channel, ``s = gamma * rsqrt(var + eps)``;
* bias ``(conv_bias - mean) * s + beta``, computed in fp32 on the host. A
  trained ``beta`` (bias-only fine-tuning) is added after the convolution as a
  read of the parameter, so its gradient stays the sum of the upstream one.

The joint graph's backward of that pair is ``convolution_backward(g * s, x, W)``
(autograd's batch-norm backward scales ``g`` by ``s``; grad_weight and grad_bias
are not asked for, the weight being frozen), which is
``convolution_backward(g, x, W * s)``: the fold rewrites it to read the folded
weight, so forward and grad_input share one stored weight (what
``input_gradient="runtime_weight"`` keeps once) and the backward loses a
multiplication. A pair whose backward does not have that form is left to
``passes.batch_norm``, one log line saying why, so no weight is stored twice.
"""

from __future__ import annotations

import logging
import operator

import torch

from .. import integration
from .batch_norm import (
    _Builder,
    _static,
    _trained_parameters,
    fold_frozen_statistics,
    rewrite_each,
)
from .gated import OptionGatedPass

logger = logging.getLogger(__name__)

# Parameter name -> the folded weight stored in its place, for every weight the pass
# folded in this process (a later fold of the same name replaces it). Tools that
# find a frozen weight's stored copies by value (``tools.cost.weight_copies``) read it.
FOLDED_WEIGHTS: dict[str, torch.Tensor] = {}

# Ops the backward's scale of ``g`` is computed with (autograd's batch-norm backward:
# rsqrt(var + eps) * gamma, unsqueezed to [C, 1, 1] / [1, C, 1, 1]).
_SCALE_OPS = (
    "aten.add.Tensor",
    "aten.add.Scalar",
    "aten.mul.Tensor",
    "aten.rsqrt.default",
    "aten.unsqueeze_copy.default",
    "aten.view_copy.default",
)


def _name(node: torch.fx.Node) -> str:
    return str(node.target).removeprefix("<EdgeOpOverload: ").split(">")[0]


class _Statics:
    """Host values of nodes computed from frozen placeholders and constants alone."""

    def __init__(self, graph_module: torch.fx.GraphModule, edge_program, trained: set[str]):
        self.gm = graph_module
        self.edge_program = edge_program
        self.trained = trained
        self.cache: dict[torch.fx.Node, torch.Tensor | None] = {}

    def value(self, node) -> torch.Tensor | None:
        if not isinstance(node, torch.fx.Node):
            return None
        if node not in self.cache:
            self.cache[node] = self._compute(node)
        return self.cache[node]

    def _compute(self, node: torch.fx.Node) -> torch.Tensor | None:
        if node.op == "placeholder":
            return None if node.name in self.trained else _static(node, self.edge_program)
        if node.op == "get_attr":
            return getattr(self.gm, node.target).detach().float()
        if node.op != "call_function" or _name(node) not in _SCALE_OPS:
            return None
        args = []
        for arg in node.args:
            if isinstance(arg, torch.fx.Node):
                value = self.value(arg)
                if value is None:
                    return None
                args.append(value)
            else:
                args.append(arg)
        return node.target(*args, **node.kwargs)


def _geometry(node: torch.fx.Node, start: int) -> tuple:
    return tuple(
        tuple(a) if isinstance(a, (list, tuple)) else a for a in node.args[start : start + 6]
    )


def _scaled_gradient(
    backward: torch.fx.Node, scale: torch.Tensor, statics: _Statics
) -> torch.fx.Node | None:
    """``g`` when ``backward``'s grad_output is ``g * s`` with ``s`` the fold's scale."""
    grad = backward.args[0]
    if not isinstance(grad, torch.fx.Node) or _name(grad) != "aten.mul.Tensor":
        return None
    full = grad.meta["val"].shape
    per_channel = scale.reshape([1, scale.numel()] + [1] * (len(full) - 2))
    for this, other in ((0, 1), (1, 0)):
        value = statics.value(grad.args[other])
        if value is None or not isinstance(grad.args[this], torch.fx.Node):
            continue
        if value.dim() > len(full) or torch.broadcast_shapes(value.shape, full) != full:
            continue
        expanded = torch.broadcast_to(value, full)
        if torch.allclose(expanded, torch.broadcast_to(per_channel, full), rtol=1e-6, atol=0):
            return grad.args[this]
    return None


def _fold_one(
    graph_module: torch.fx.GraphModule,
    bn: torch.fx.Node,
    edge_program,
    trained: set[str],
    statics: _Statics,
) -> bool:
    ops = integration.get("ops").edge.aten
    conv, gamma, beta, mean, var = bn.args[:5]
    eps = float(bn.args[6])

    def keep(reason: str) -> bool:
        logger.info("batch norm %s: not folded into a convolution: %s", bn.name, reason)
        return False

    if not isinstance(conv, torch.fx.Node) or conv.target != ops.convolution.default:
        return False  # not after a convolution: nothing to say
    if not all(u.target is operator.getitem and u.args[1] == 0 for u in bn.users):
        return keep("its saved statistics are read")
    x, weight, conv_bias = conv.args[:3]
    if conv.args[6]:
        return keep(f"{conv.name} is a transposed convolution")

    def frozen(node, what: str) -> torch.Tensor | None:
        if node is None:
            return None
        if node.name in trained:
            raise _Kept(f"{what} {node.name} trains")
        value = _static(node, edge_program)
        if value is None:
            raise _Kept(f"{what} {node.name} is not a constant")
        return value

    try:
        w = frozen(weight, "the convolution weight")
        cb = frozen(conv_bias, "the convolution bias")
        g = frozen(gamma, "the batch-norm weight")
        m = frozen(mean, "the running mean")
        v = frozen(var, "the running variance")
    except _Kept as kept:
        return keep(str(kept))
    if m is None or v is None:
        return keep("no running statistics")
    if len(conv.users) != 1:
        return keep(f"{conv.name}'s output is read by {len(conv.users)} nodes")
    channels = m.numel()
    scale = torch.rsqrt(v + eps) if g is None else g * torch.rsqrt(v + eps)

    # Every other reader of the weight must be a backward of this convolution whose
    # grad_output is g * scale: rewritten to (g, folded weight), the weight is stored once.
    backwards = [u for u in weight.users if u is not conv]
    rewrites = []
    for user in backwards:
        if (
            user.target != ops.convolution_backward.default
            or user.args[1] is not x
            or user.args[2] is not weight
            or _geometry(user, 4) != _geometry(conv, 3)
            or tuple(user.args[10]) != (True, False, False)
        ):
            return keep(f"weight {weight.name} is also read by {user.name}")
        upstream = _scaled_gradient(user, scale, statics)
        if upstream is None:
            return keep(f"{user.name}'s grad_output is not the batch norm's gradient x its scale")
        rewrites.append((user, upstream))

    trained_beta = beta is not None and beta.name in trained
    beta_value = None if beta is None or trained_beta else _static(beta, edge_program)
    if beta is not None and not trained_beta and beta_value is None:
        return keep(f"the batch-norm bias {beta.name} is not a constant")
    folded_bias = ((0 if cb is None else cb) - m) * scale
    if beta_value is not None:
        folded_bias = folded_bias + beta_value

    build = _Builder(graph_module, conv)
    per_output_channel = scale.reshape([channels] + [1] * (w.dim() - 1))
    folded_weight = w * per_output_channel
    new_weight = build.constant("folded_weight", folded_weight)
    parameter = edge_program.graph_signature.inputs_to_parameters.get(weight.name)
    if parameter is not None:
        FOLDED_WEIGHTS[parameter] = folded_weight
    new_bias = build.constant("folded_bias", folded_bias)
    conv.args = (x, new_weight, new_bias, *conv.args[3:])
    out = conv
    if trained_beta:  # a read of the parameter: a read of the parameter
        after = _Builder(graph_module, bn)
        view = after.call(ops.view_copy.default, beta, [1, channels, *([1] * (w.dim() - 2))])
        out = after.call(ops.add.Tensor, conv, view)
    for user in list(bn.users):
        user.replace_all_uses_with(out)
        graph_module.graph.erase_node(user)
    graph_module.graph.erase_node(bn)
    for backward, upstream in rewrites:
        backward.args = (upstream, x, new_weight, *backward.args[3:])
    logger.info(
        "batch norm %s: folded into %s (%d backward(s) read the folded weight)",
        bn.name,
        conv.name,
        len(rewrites),
    )
    return True


class _Kept(Exception):
    pass


def fold_batch_norms(graph_module: torch.fx.GraphModule, edge_program) -> int:
    """Fold each eval-mode batch norm after a frozen convolution into it; returns how many."""
    if edge_program is None:
        return 0
    trained = _trained_parameters(edge_program)
    statics = _Statics(graph_module, edge_program, trained)
    return rewrite_each(
        graph_module, lambda node: _fold_one(graph_module, node, edge_program, trained, statics)
    )


class FoldConvolutionBatchNorm(OptionGatedPass):
    """to_edge transform pass running ``fold_batch_norms`` (``batch_norm="fold"``)."""

    def enabled(self, options) -> bool:
        return options.batch_norm == "fold"

    def rewrite(self, graph_module: torch.fx.GraphModule) -> int:
        changed = fold_batch_norms(graph_module, self.edge_program)
        if changed:
            # Arithmetic on running statistics alone (the backward's scales of the
            # pairs not folded) becomes fp32 host constants, as StableBatchNorm does.
            changed += fold_frozen_statistics(graph_module, self.edge_program)
        return changed
