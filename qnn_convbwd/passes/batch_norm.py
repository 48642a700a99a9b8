"""Eval-mode batch norm as element-wise ops, with the module's own epsilon.

executorch's QNN visitor of ``aten._native_batch_norm_legit_no_training``
(``builders/op_batch_norm.py``) builds one QNN Batchnorm with the static
filter ``w / sqrt(var + 1e-9)`` and bias ``b - filter * mean``: the epsilon is
hard-coded and the node's own (``args[6]``, 1e-5 for ``nn.BatchNorm2d``) is
never read. Channels whose running variance is near or below the epsilon are
scaled up to ``sqrt((var + eps) / (var + 1e-9))`` times too much (measured: 125 %
error for var = 1e-6, the same on V69 to V81; docs/numerics.md).

``StableBatchNorm`` rewrites each such node into ``(x - mean) * scale + b``
with per-channel ``[1, C, 1, ...]`` operands:

* ``mean`` and ``rsqrt(var + eps)`` of the frozen running statistics are
  computed in fp32 on the host and become constants;
* a frozen weight is folded into the constant ``scale = w * rsqrt(var + eps)``;
  a trained one (its gradient is a program output) stays a graph read:
  ``(x - mean) * rsqrt(var + eps) * w + b``;
* the bias is added as a constant when frozen, as a reshape of the parameter
  when trained.

The joint graph's backward is already decomposed by autograd: it reads the
batch norm's input and the running statistics, and computes ``rsqrt(var + eps)``
with the node's epsilon, so forward and backward now agree (with executorch's
visitor the forward used 1e-9, the backward 1e-5). ``fold_frozen_statistics``
computes that backward arithmetic on the running statistics (``add``, ``rsqrt``,
reshapes) in fp32 on the host, as the forward's constants are: on the HTP it
ran in fp16, where variances below 6.1e-5 are subnormal.

Only state the program never writes is a constant here. A buffer the program
mutates (a train-mode batch norm's running statistics, a parameter the in-program
optimizer updates, its state, its step count) is read at run time: folding
arithmetic on it would bake its initial value into the program, and a folded
mutation (the optimizer's ``step + 1``) leaves a buffer written from a constant,
which executorch's program verifier rejects.
"""

from __future__ import annotations

import logging
import operator

import torch

from .. import integration, nodes, signature
from .gated import OptionGatedPass
from .graph_builder import NodeBuilder

logger = logging.getLogger(__name__)


def _trained_parameters(edge_program) -> set[str]:
    """Placeholder names of the trainable parameters: those whose gradient the program
    outputs, and those its own optimizer updates (buffers, ``passes.optimizer``)."""
    if edge_program is None:
        return set()
    trainable = signature.trainable_parameters(edge_program)
    return {
        spec.arg.name
        for spec in edge_program.graph_signature.input_specs
        if spec.kind.name in ("PARAMETER", "BUFFER") and spec.target in trainable
    }


def _mutated(node: torch.fx.Node, edge_program) -> bool:
    """``node`` is the placeholder of a buffer the program writes back."""
    graph_signature = edge_program.graph_signature
    target = graph_signature.inputs_to_buffers.get(node.name)
    return target is not None and target in set(graph_signature.buffers_to_mutate.values())


def _static(node: torch.fx.Node | None, edge_program) -> torch.Tensor | None:
    """The value of a parameter, buffer or lifted constant the program never writes;
    None for anything else (a mutated buffer changes from one step to the next)."""
    if node is None or edge_program is None:
        return None
    if not integration.get("is_parameter")(node, edge_program) or _mutated(node, edge_program):
        return None
    return integration.get("get_parameter")(node, edge_program).detach().float()


def _rewrite(
    graph_module: torch.fx.GraphModule,
    node: torch.fx.Node,
    edge_program,
    trained: set[str],
    fold_weight: bool,
) -> bool:
    x, weight, bias, mean, var = node.args[:5]
    eps = float(node.args[6])
    users = list(node.users)
    if not all(u.target is operator.getitem and u.args[1] == 0 for u in users):
        logger.info("batch norm %s: kept (its saved statistics are read)", node.name)
        return False
    mean_t, var_t = _static(mean, edge_program), _static(var, edge_program)
    if mean_t is None or var_t is None:
        logger.info("batch norm %s: kept (running statistics are not constants)", node.name)
        return False
    shape = [1, mean_t.numel(), *([1] * (x.meta["val"].dim() - 2))]
    b = NodeBuilder(graph_module, node)
    rstd = torch.rsqrt(var_t + eps)

    def frozen(param: torch.fx.Node) -> torch.Tensor | None:
        return None if param.name in trained else _static(param, edge_program)

    def operand(param: torch.fx.Node, name: str, times: torch.Tensor | None = None):
        """A trained parameter as a reshape of its read; a frozen one as a constant."""
        value = frozen(param)
        if value is None:
            return b.call(b.ops.view_copy.default, param, shape)
        return b.constant(name, (value if times is None else value * times).reshape(shape))

    centred = b.call(b.ops.sub.Tensor, x, b.constant("mean", mean_t.reshape(shape)))
    if weight is None:
        out = b.call(b.ops.mul.Tensor, centred, b.constant("scale", rstd.reshape(shape)))
    elif fold_weight and frozen(weight) is not None:
        out = b.call(b.ops.mul.Tensor, centred, operand(weight, "scale", times=rstd))
    else:
        out = b.call(b.ops.mul.Tensor, centred, b.constant("rstd", rstd.reshape(shape)))
        out = b.call(b.ops.mul.Tensor, out, operand(weight, "w"))
    if bias is not None:
        out = b.call(b.ops.add.Tensor, out, operand(bias, "b"))
    for user in users:
        user.replace_all_uses_with(out)
        graph_module.graph.erase_node(user)
    graph_module.graph.erase_node(node)
    return True


# Ops on running statistics that fold_frozen_statistics computes on the host.
_FOLDABLE = (
    "aten.add.Tensor",
    "aten.add.Scalar",
    "aten.sub.Tensor",
    "aten.mul.Tensor",
    "aten.rsqrt.default",
    "aten.sqrt.default",
    "aten.unsqueeze_copy.default",
    "aten.view_copy.default",
)


def fold_frozen_statistics(graph_module: torch.fx.GraphModule, edge_program) -> int:
    """Replace arithmetic on buffers the program never writes (frozen running
    statistics) alone by fp32 constants."""
    if edge_program is None:
        return 0
    buffers = {
        spec.arg.name
        for spec in edge_program.graph_signature.input_specs
        if spec.kind.name == "BUFFER"
    }
    values: dict[torch.fx.Node, torch.Tensor] = {}
    folded = 0
    for node in list(graph_module.graph.nodes):
        if node.op == "placeholder" and node.name in buffers:
            value = _static(node, edge_program)
            if value is not None:
                values[node] = value
            continue
        if node.op != "call_function" or not any(
            str(node.target).startswith(f"<EdgeOpOverload: {op}>") for op in _FOLDABLE
        ):
            continue
        if not node.all_input_nodes or not all(a in values for a in node.all_input_nodes):
            continue
        args = [values[a] if isinstance(a, torch.fx.Node) else a for a in node.args]
        value = node.target(*args, **node.kwargs)
        values[node] = value
        constant = NodeBuilder(graph_module, node).constant("folded", value)
        node.replace_all_uses_with(constant)
        graph_module.graph.erase_node(node)
        values[constant] = value
        folded += 1
    if folded:
        graph_module.graph.eliminate_dead_code()
        graph_module.recompile()
    return folded


def decompose_batch_norm(
    graph_module: torch.fx.GraphModule, edge_program, fold_weight: bool = True
) -> int:
    """Rewrite every eval-mode batch norm of ``graph_module``; returns how many.

    ``fold_weight`` folds a frozen weight into the scale constant (otherwise it
    is multiplied in on the device, like a trained one).
    """
    trained = _trained_parameters(edge_program)
    return rewrite_each(
        graph_module, lambda node: _rewrite(graph_module, node, edge_program, trained, fold_weight)
    )


def rewrite_each(graph_module: torch.fx.GraphModule, rewrite_one) -> int:
    """``rewrite_one(node)`` (True: rewritten) on every eval-mode batch norm; then dead
    code is dropped and the module recompiled. Returns how many were rewritten."""
    changed = 0
    for node in list(graph_module.graph.nodes):
        if (
            node.op == "call_function"
            and node.target == nodes.edge_aten()._native_batch_norm_legit_no_training.default
        ):
            changed += rewrite_one(node)
    if changed:
        graph_module.graph.eliminate_dead_code()
        graph_module.recompile()
    return changed


class StableBatchNorm(OptionGatedPass):
    """to_edge transform pass running ``decompose_batch_norm`` (options.batch_norm)."""

    # Fold a frozen weight into the scale constant (see decompose_batch_norm).
    fold_weight = True

    def enabled(self, options) -> bool:
        return options.batch_norm in ("fold", "fold_device", "fold_frozen", "decompose")

    def rewrite(self, graph_module: torch.fx.GraphModule) -> int:
        changed = decompose_batch_norm(graph_module, self.edge_program, self.fold_weight)
        if changed:
            changed += fold_frozen_statistics(graph_module, self.edge_program)
        return changed
