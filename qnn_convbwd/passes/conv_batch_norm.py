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

When the convolution's weight trains (full or last-layers fine-tuning) the fold
is done on the device (``_fold_trained``): ``W * s`` and the bias are graph ops
on the parameters, and the backward is rewritten to match. With
``batch_norm="fold"`` only where that does less element-wise work a step than
the batch norm (``_fold_saves_work``: not in the deep, weight-heavy layers),
with ``"fold_device"`` for every such pair (docs/numerics.md).
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import operator
from collections.abc import Callable, Iterator

import torch

from .. import integration
from .batch_norm import (
    _static,
    _trained_parameters,
    fold_frozen_statistics,
    rewrite_each,
)
from .gated import OptionGatedPass
from .graph_builder import NodeBuilder

logger = logging.getLogger(__name__)

# Called with (parameter name, the folded weight stored in its place) for each weight
# the pass folds, while registered with ``observe_folds``; nothing is kept otherwise.
_fold_observers: list[Callable[[str, torch.Tensor], None]] = []


@contextlib.contextmanager
def observe_folds(callback: Callable[[str, torch.Tensor], None]) -> Iterator[None]:
    """Call ``callback(parameter, folded_weight)`` for each weight the pass folds while
    the block runs: the values the lowering stores in place of that parameter (the Saver
    recording and ``qnn_convbwd_dev.cost.weight_copies`` find a weight's copies by them)."""
    _fold_observers.append(callback)
    try:
        yield
    finally:
        _fold_observers.remove(callback)


def folds_observed() -> bool:
    """Whether an ``observe_folds`` block is running (a lowering must then run the pass)."""
    return bool(_fold_observers)


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


# Which trained pairs each batch_norm mode folds on the device (fold_batch_norms).
FOLD_TRAINED = ("always", "cheaper", "never")
FOLD_TRAINED_BY_MODE = {"fold": "cheaper", "fold_device": "always", "fold_frozen": "never"}


def _name(node: torch.fx.Node) -> str:
    return str(node.target).removeprefix("<EdgeOpOverload: ").split(">")[0]


class _Statics:
    """Host values of nodes computed from frozen placeholders and constants alone."""

    def __init__(
        self,
        graph_module: torch.fx.GraphModule,
        edge_program,
        trained: set[str],
        probes: dict[torch.fx.Node, torch.Tensor] | None = None,
    ):
        self.gm = graph_module
        self.edge_program = edge_program
        self.trained = trained
        # Trained placeholders given a probe value: an expression of them evaluates
        # with it (how a scale computed from a trained batch-norm weight is recognised).
        self.probes = probes or {}
        self.cache: dict[torch.fx.Node, torch.Tensor | None] = {}

    def value(self, node) -> torch.Tensor | None:
        if not isinstance(node, torch.fx.Node):
            return None
        if node not in self.cache:
            self.cache[node] = self._compute(node)
        return self.cache[node]

    def _compute(self, node: torch.fx.Node) -> torch.Tensor | None:
        if node in self.probes:
            return self.probes[node]
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


def _fold_saves_work(conv: torch.fx.Node, weight: torch.fx.Node, gamma, trained: set[str]) -> None:
    """Raise _Kept unless folding a trained pair on the device does less element-wise work.

    The device fold adds weight-sized ops each step (``W * s``, ``dW' * s``; with a
    trained gamma ``dW' * W`` and its sum) and removes activation-sized ones (the
    forward's ``- mean``, ``* scale``, ``+ beta``, the backward's ``g * s``; with a
    trained gamma ``conv - mean``, its product with ``g`` and the sum). Where the
    weight outnumbers the activation (deep layers at small spatial sizes: resnet18's
    3x3 convolutions at 32 px hold 9-4608x their output) the element-wise form is the
    cheaper one, and on resnet18 the more accurate (docs/numerics.md).
    """
    gamma_trains = isinstance(gamma, torch.fx.Node) and gamma.name in trained
    weight_elements = weight.meta["val"].numel()
    activation_elements = conv.meta["val"].numel()
    added = weight_elements * (4 if gamma_trains else 2)
    removed = activation_elements * (7 if gamma_trains else 4)
    if added >= removed:
        raise _Kept(
            f"the convolution weight {weight.name} trains and folding it on the device "
            f"adds {added} weight-sized element operations a step for {removed} "
            f"activation-sized ones"
        )


def _fold_one(
    graph_module: torch.fx.GraphModule,
    bn: torch.fx.Node,
    edge_program,
    trained: set[str],
    statics: _Statics,
    fold_trained: str = "always",
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
    if isinstance(weight, torch.fx.Node) and weight.name in trained:
        if fold_trained == "never":
            return keep(f"the convolution weight {weight.name} trains")
        try:
            if fold_trained == "cheaper":
                _fold_saves_work(conv, weight, gamma, trained)
            return _fold_trained(graph_module, bn, edge_program, trained, statics)
        except _Kept as kept:
            return keep(str(kept))

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

    build = NodeBuilder(graph_module, conv)
    per_output_channel = scale.reshape([channels] + [1] * (w.dim() - 1))
    folded_weight = w * per_output_channel
    new_weight = build.constant("folded_weight", folded_weight)
    parameter = edge_program.graph_signature.inputs_to_parameters.get(weight.name)
    if parameter is not None:
        for observer in list(_fold_observers):
            observer(parameter, folded_weight)
    new_bias = build.constant("folded_bias", folded_bias)
    conv.args = (x, new_weight, new_bias, *conv.args[3:])
    out = conv
    if trained_beta:  # added after the convolution as a read of the parameter
        after = NodeBuilder(graph_module, bn)
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


def _static_or_trained(node, what: str, trained: set[str], edge_program):
    """``(value, trains)`` of an optional parameter operand; _Kept when neither."""
    if node is None:
        return None, False
    if node.name in trained:
        return None, True
    value = _static(node, edge_program)
    if value is None:
        raise _Kept(f"{what} {node.name} is not a constant")
    return value, False


def _reduces_all_but_channels(node: torch.fx.Node, rank: int) -> bool:
    if _name(node) != "aten.sum.dim_IntList" or node.kwargs.get("dtype") is not None:
        return False
    if len(node.args) > 2 and node.args[2]:
        return False  # keepdim
    dims = sorted(d % rank for d in node.args[1])
    return dims == [0, *range(2, rank)]


def _gamma_gradient_sum(
    conv: torch.fx.Node, bn: torch.fx.Node, upstream: torch.fx.Node, mean: torch.Tensor, statics
) -> torch.fx.Node:
    """autograd's ``sum(g * (conv - mean), all but channels)`` in grad_gamma (gamma trains).

    It is the only other reader of the convolution's output; _Kept otherwise.
    """
    readers = [u for u in conv.users if u is not bn]
    reason = f"{conv.name}'s output is read by {len(readers) + 1} nodes"
    if len(readers) != 1:
        raise _Kept(reason)
    centred = readers[0]
    rank = conv.meta["val"].dim()
    if _name(centred) != "aten.sub.Tensor" or centred.args[0] is not conv or centred.kwargs:
        raise _Kept(f"{reason}: {centred.name} is not the batch norm's centring")
    value = statics.value(centred.args[1])
    shape = [1, mean.numel()] + [1] * (rank - 2)
    if value is None or value.numel() != mean.numel():
        raise _Kept(f"{centred.name} does not subtract the running mean")
    if not torch.equal(value.reshape(shape), mean.reshape(shape)):
        raise _Kept(f"{centred.name} does not subtract the running mean")
    (product,) = centred.users if len(centred.users) == 1 else (None,)
    if (
        product is None
        or _name(product) != "aten.mul.Tensor"
        or set(product.args) != {upstream, centred}
        or len(product.users) != 1
    ):
        raise _Kept(f"{centred.name} is not read as grad_gamma's product alone")
    (total,) = product.users
    if not _reduces_all_but_channels(total, rank):
        raise _Kept(f"{product.name} is not reduced to grad_gamma's per-channel sum")
    return total


def _fold_trained(
    graph_module: torch.fx.GraphModule,
    bn: torch.fx.Node,
    edge_program,
    trained: set[str],
    statics: _Statics,
) -> bool:
    """The pair when the convolution weight trains (full or last-layers fine-tuning).

    The folded weight ``W * s`` and bias ``(conv_bias - mean) * s + beta`` are
    computed on the device from the parameters read that step (``s = gamma *
    rsqrt(var + eps)``, the running statistics' part an fp32 host constant), so the
    batch norm's shift is added in the convolution's accumulator like a frozen
    fold's. The backward ``convolution_backward(g * s, x, W)`` becomes
    ``(g, x, W * s)``, whose grad_weight ``dW'`` and grad_bias are scaled by ``s``
    to the parameters' gradients; when gamma trains, autograd's
    ``sum(g * (conv_out - mean))`` (which read the unfolded output, no longer
    computed) is ``sum(dW' * W) + (conv_bias - mean) * sum(g)``.
    """
    ops = integration.get("ops").edge.aten
    conv, gamma, beta, mean, var = bn.args[:5]
    eps = float(bn.args[6])
    x, weight, conv_bias = conv.args[:3]
    m, v = _static(mean, edge_program), _static(var, edge_program)
    if m is None or v is None:
        raise _Kept("the running statistics are not constants")
    channels = m.numel()
    rank = weight.meta["val"].dim()
    rstd = torch.rsqrt(v + eps)
    g_value, g_trains = _static_or_trained(gamma, "the batch-norm weight", trained, edge_program)
    cb_value, cb_trains = _static_or_trained(
        conv_bias, "the convolution bias", trained, edge_program
    )
    beta_value, beta_trains = _static_or_trained(beta, "the batch-norm bias", trained, edge_program)

    backwards = [u for u in weight.users if u is not conv]
    if len(backwards) != 1:
        raise _Kept(f"weight {weight.name} has {len(backwards)} readers besides {conv.name}")
    (backward,) = backwards
    if (
        backward.target != ops.convolution_backward.default
        or backward.args[1] is not x
        or backward.args[2] is not weight
        or _geometry(backward, 4) != _geometry(conv, 3)
        or not backward.args[10][1]
    ):
        raise _Kept(f"weight {weight.name} is also read by {backward.name}")
    if g_trains:
        # autograd's scale reads gamma: recognised by evaluating it with a probe gamma
        probe = torch.linspace(0.5, 1.5, channels)
        local = _Statics(graph_module, edge_program, trained, {gamma: probe})
        upstream = _scaled_gradient(backward, probe * rstd, local)
    else:
        scale_value = rstd if g_value is None else g_value * rstd
        upstream = _scaled_gradient(backward, scale_value, statics)
    if upstream is None:
        raise _Kept(f"{backward.name}'s grad_output is not the batch norm's gradient x its scale")
    gamma_sum = _gamma_gradient_sum(conv, bn, upstream, m, statics) if g_trains else None
    if not g_trains and len(conv.users) != 1:
        raise _Kept(f"{conv.name}'s output is read by {len(conv.users)} nodes")
    getitems = {u.args[1]: u for u in backward.users if u.target is operator.getitem}
    if len(getitems) != len(backward.users) or 1 not in getitems:
        raise _Kept(f"{backward.name}'s outputs are not read as its grad_weight and others")

    fwd = NodeBuilder(graph_module, conv)
    filter_shape = [channels] + [1] * (rank - 1)
    if g_trains:
        s_vec = fwd.call(ops.mul.Tensor, gamma, fwd.constant("rstd", rstd))
        s_filter = fwd.call(ops.view_copy.default, s_vec, filter_shape)
    else:
        s_vec = fwd.constant("scale", scale_value)
        s_filter = fwd.constant("filter_scale", scale_value.reshape(filter_shape))
    new_weight = fwd.call(ops.mul.Tensor, weight, s_filter)
    # (conv_bias - mean) * s + beta
    offset = None  # conv_bias - mean, as a node (conv bias trains) or a value
    if cb_trains:
        offset = fwd.call(ops.sub.Tensor, conv_bias, fwd.constant("mean", m))
        bias = fwd.call(ops.mul.Tensor, offset, s_vec)
    else:
        offset = (0 if cb_value is None else cb_value) - m
        if g_trains:
            bias = fwd.call(ops.mul.Tensor, gamma, fwd.constant("offset", offset * rstd))
        else:
            bias = offset * scale_value
    # A trained beta is added after the convolution, as in the frozen fold. Summed
    # into the convolution's bias on the device the step was less accurate, even with
    # beta = 0 (MobileNetV3-Small's features[:9], fully trained, SM8650: loss relative
    # error 2.6e-3 that way, 1.4e-3 added after; the mechanism was not found).
    if beta_value is not None:
        if isinstance(bias, torch.fx.Node):
            bias = fwd.call(ops.add.Tensor, bias, fwd.constant("beta", beta_value))
        else:
            bias = bias + beta_value
    if not isinstance(bias, torch.fx.Node):
        bias = fwd.constant("folded_bias", bias)
    conv.args = (x, new_weight, bias, *conv.args[3:])
    out = conv
    if beta_trains:
        after_bn = NodeBuilder(graph_module, bn)
        view = after_bn.call(ops.view_copy.default, beta, [1, channels, *([1] * (rank - 2))])
        out = after_bn.call(ops.add.Tensor, conv, view)
    for user in list(bn.users):
        user.replace_all_uses_with(out)
        graph_module.graph.erase_node(user)
    graph_module.graph.erase_node(bn)

    backward.args = (upstream, x, new_weight, *backward.args[3:])
    folded_grad = getitems[1]  # dW', the folded weight's gradient
    after = NodeBuilder(graph_module, backward, before=folded_grad.next)
    grad_weight = after.call(ops.mul.Tensor, folded_grad, s_filter)
    folded_grad.replace_all_uses_with(grad_weight, delete_user_cb=lambda u: u is not grad_weight)
    if 2 in getitems:  # grad of the convolution bias: sum(g) * s
        grad_b = getitems[2]
        scaled = NodeBuilder(graph_module, backward, before=grad_b.next).call(
            ops.mul.Tensor, grad_b, s_vec
        )
        grad_b.replace_all_uses_with(scaled, delete_user_cb=lambda u: u is not scaled)
    if gamma_sum is not None:
        # sum(g * (conv_out - mean)) = sum(dW' * W) + (conv_bias - mean) * sum(g)
        build = NodeBuilder(graph_module, backward, before=grad_weight)
        taps = build.call(
            ops.sum.dim_IntList,
            build.call(ops.mul.Tensor, folded_grad, weight),
            list(range(1, rank)),
        )
        spatial = conv.meta["val"].dim()
        upstream_sum = build.call(ops.sum.dim_IntList, upstream, [0, *range(2, spatial)])
        if not isinstance(offset, torch.fx.Node):
            offset = build.constant("offset", offset)
        shift = build.call(ops.mul.Tensor, upstream_sum, offset)
        gamma_sum.replace_all_uses_with(build.call(ops.add.Tensor, taps, shift))
        _sort_topologically(graph_module.graph)
    logger.info(
        "batch norm %s: folded into %s, whose weight trains (the folded weight is "
        "computed on the device)",
        bn.name,
        conv.name,
    )
    return True


def _sort_topologically(graph: torch.fx.Graph) -> None:
    """Reorder ``graph`` so every node follows its inputs, keeping the order otherwise.

    ``_fold_trained`` makes grad_gamma read grad_weight, computed later in autograd's
    order.
    """
    order = [n for n in graph.nodes if n.op != "output"]
    index = {n: i for i, n in enumerate(order)}
    waiting = {n: len(n.all_input_nodes) for n in order}
    ready = [index[n] for n in order if not waiting[n]]
    heapq.heapify(ready)
    placed = []
    while ready:
        node = order[heapq.heappop(ready)]
        placed.append(node)
        for user in node.users:
            if user in waiting:
                waiting[user] -= 1
                if not waiting[user]:
                    heapq.heappush(ready, index[user])
    if len(placed) != len(order):
        raise RuntimeError("qnn_convbwd: the graph has a cycle after folding batch norms")
    for before, node in zip(placed, placed[1:]):
        before.append(node)


class _Kept(Exception):
    pass


def fold_batch_norms(
    graph_module: torch.fx.GraphModule, edge_program, fold_trained: str = "always"
) -> int:
    """Fold each eval-mode batch norm after a convolution into it; returns how many.

    ``fold_trained`` says which pairs whose convolution weight trains are folded on
    the device (``_fold_trained``): ``"always"``, ``"cheaper"`` (where that does less
    element-wise work, ``_fold_saves_work``) or ``"never"``.
    """
    if fold_trained not in FOLD_TRAINED:
        raise ValueError(f"fold_trained={fold_trained!r}: one of {FOLD_TRAINED}")
    if edge_program is None:
        return 0
    trained = _trained_parameters(edge_program)
    statics = _Statics(graph_module, edge_program, trained)
    return rewrite_each(
        graph_module,
        lambda node: _fold_one(graph_module, node, edge_program, trained, statics, fold_trained),
    )


class FoldConvolutionBatchNorm(OptionGatedPass):
    """to_edge transform pass running ``fold_batch_norms`` (``batch_norm="fold"``,
    ``"fold_device"`` or ``"fold_frozen"``)."""

    def enabled(self, options) -> bool:
        return options.batch_norm in FOLD_TRAINED_BY_MODE

    def rewrite(self, graph_module: torch.fx.GraphModule) -> int:
        from .. import options

        fold_trained = FOLD_TRAINED_BY_MODE[options.current.batch_norm]
        changed = fold_batch_norms(graph_module, self.edge_program, fold_trained)
        if changed:
            # Arithmetic on running statistics alone (the backward's scales of the
            # pairs not folded) becomes fp32 host constants, as StableBatchNorm does.
            changed += fold_frozen_statistics(graph_module, self.edge_program)
        return changed
