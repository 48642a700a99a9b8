"""1-D convolution_backward as a 2-D one with a unit height.

executorch's CanonicalizeConv turns every 1-D ``convolution`` into
``unsqueeze -> conv2d -> squeeze`` and gives it a 4-D copy of the weight
(``[C_out, C_in/g, 1, k]``) as a ``get_attr`` buffer. This pass does the same for
``convolution_backward``: grad_output and input gain a unit height at dim 2, the
node becomes 2-D (stride, padding, dilation get a leading 1 / 0 / 1) and every
gradient it returns loses that height again.

Every non-transposed 1-D node is lifted, wherever it will run:

* a node the support rules delegate reads the forward convolution's 4-D buffer
  when a canonicalized forward convolution reads the same parameter, so the
  forward and backward share one stored weight; otherwise a 4-D buffer of its
  own is registered the way CanonicalizeConv does. The reshapes are
  ``unsqueeze_copy`` / ``squeeze_copy`` and are delegated with the node.
* a node that stays on CPU (rejected by a rule, or kept there by executorch's
  skip options) is lifted because executorch's portable CPU kernel computes
  2-D convolution_backward only. It reads its own weight operand, whatever
  that is (parameter, buffer, graph input, a dequantize), through a
  ``view_copy``: executorch turns a ``view_copy`` into a view of its base
  (``ReplaceViewCopyWithViewPass``), so the weight is not stored or copied a
  second time. The node and its reshapes carry ``ON_CPU`` and stay on CPU, and
  the node carries the decision taken on its 1-D form (``meta.PINNED``):
  the rules would judge the rewritten operands, not the user's node.

The node is rewritten in place, so it keeps its name (executorch's
``skip_node_id_set`` names nodes) and its metadata; its getitems keep theirs.
Transposed nodes are left alone: no kernel of ours or executorch's computes
them, lifted or not.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch

from .. import integration, nodes, signature
from ..geometry import conv as geo
from ..meta import ON_CPU, PINNED
from ..partition.verdict import Decision


def _forward_weight(graph_module, weight_node, edge_program) -> torch.fx.Node | None:
    """The 4-D get_attr CanonicalizeConv gave a forward conv of the same weight.

    CanonicalizeConv does not record which parameter a buffer came from; the
    buffer holding exactly this weight with a unit height is the one.
    """
    conv = integration.get("ops").edge.aten.convolution.default
    wanted = integration.get("get_parameter")(weight_node, edge_program).detach().unsqueeze(2)
    for node in graph_module.graph.nodes:
        if node.op != "call_function" or node.target != conv:
            continue
        weight = node.args[1]
        if weight.op != "get_attr":
            continue
        buffer = getattr(graph_module, weight.target, None)
        if isinstance(buffer, torch.Tensor) and buffer.shape == wanted.shape:
            if torch.equal(buffer, wanted):
                return weight
    return None


def _register_weight(graph_module, weight_node, edge_program) -> torch.fx.Node:
    """A 4-D buffer holding the 1-D weight with a unit height (CanonicalizeConv's way)."""
    value = integration.get("get_parameter")(weight_node, edge_program).detach().unsqueeze(2)
    name = integration.get("get_new_attr_name_with_prefix")(f"{weight_node.name}_conv2d")(
        graph_module
    )
    graph_module.register_buffer(name, value.contiguous())
    with graph_module.graph.inserting_after(weight_node):
        node = graph_module.graph.get_attr(name)
    fake_mode = integration.get("detect_fake_mode")(weight_node.meta["val"])
    node.meta["val"] = fake_mode.fake_tensor_converter.from_real_tensor(fake_mode, value)
    return node


def _bakeable(weight_node: torch.fx.Node, edge_program) -> bool:
    """A weight whose values may become a new constant: frozen, and a constant."""
    return integration.get("is_parameter")(
        weight_node, edge_program
    ) and not signature.is_trainable_parameter(weight_node, edge_program)


def unbake_trainable_weights(graph_module: torch.fx.GraphModule, edge_program) -> int:
    """Forward 1-D convolutions read their trainable weight again, not a frozen copy.

    executorch's CanonicalizeConv turns a 1-D convolution into a 2-D one and
    gives it a new constant holding the weight with a unit height, also when
    the weight is trainable: the delegate would then compute the forward pass
    with the initial weight forever. The copy is found by its value (as in
    ``_forward_weight``) and replaced by ``unsqueeze_copy`` of the parameter,
    read at run time. Two trainable weights of equal value leave it ambiguous
    which one the copy came from: that fails loudly.
    """
    if edge_program is None:
        return 0
    trainable = signature.trainable_placeholders(edge_program, graph_module.graph)
    if not trainable:
        return 0
    conv = integration.get("ops").edge.aten.convolution.default
    ops = integration.get("ops").edge.aten
    replaced = 0
    for node in list(graph_module.graph.nodes):
        if node.op != "call_function" or node.target != conv:
            continue
        weight = node.args[1]
        if not isinstance(weight, torch.fx.Node) or weight.op != "get_attr":
            continue
        buffer = getattr(graph_module, weight.target, None)
        if not isinstance(buffer, torch.Tensor) or buffer.dim() != 4 or buffer.shape[2] != 1:
            continue
        sources = [
            p
            for p in trainable
            if tuple(p.meta["val"].shape) == (buffer.shape[0], buffer.shape[1], buffer.shape[3])
            and torch.equal(integration.get("get_parameter")(p, edge_program).unsqueeze(2), buffer)
        ]
        if not sources:
            continue
        if len(sources) > 1:
            raise ValueError(
                f"{node.name}: its 1-D weight copy equals several trainable parameters "
                f"({[p.name for p in sources]}); cannot tell which one it reads"
            )
        with graph_module.graph.inserting_before(node):
            lifted = _call(
                graph_module.graph,
                ops.unsqueeze_copy.default,
                (sources[0], 2),
                sources[0].meta["val"].unsqueeze(2),
                sources[0],
            )
        node.replace_input_with(weight, lifted)
        replaced += 1
    if replaced:
        graph_module.graph.eliminate_dead_code()
        graph_module.recompile()
    return replaced


def _call(graph, target, args, value, like: torch.fx.Node):
    node = graph.create_node("call_function", target, args)
    node.meta.update({k: v for k, v in like.meta.items() if k not in ("val",)})
    node.meta["val"] = value
    return node


def _static(value: torch.Tensor) -> bool:
    return all(isinstance(d, int) for d in value.shape)


class _Reshapes:
    """How the lift adds and removes the unit height, for the node's destination."""

    def __init__(self, node: torch.fx.Node, on_cpu: bool) -> None:
        self.node = node
        self.on_cpu = on_cpu
        self.ops = integration.get("ops").edge.aten

    def _mark(self, created: torch.fx.Node) -> torch.fx.Node:
        if self.on_cpu:
            created.meta[ON_CPU] = self.node.name
        return created

    def unsqueeze(self, graph, source: torch.fx.Node, like: torch.fx.Node) -> torch.fx.Node:
        value = source.meta["val"].unsqueeze(2)
        if self.on_cpu and _static(value):
            args = (source, list(value.shape))
            return self._mark(_call(graph, self.ops.view_copy.default, args, value, like))
        target = self.ops.unsqueeze_copy.default
        return self._mark(_call(graph, target, (source, 2), value, like))

    def squeeze(self, graph, item: torch.fx.Node, value, like: torch.fx.Node) -> torch.fx.Node:
        if self.on_cpu and _static(value):
            args = (item, list(value.shape))
            return self._mark(_call(graph, self.ops.view_copy.default, args, value, like))
        target = self.ops.squeeze_copy.dims
        return self._mark(_call(graph, target, (item, [2]), value, like))


def lift_conv1d(
    graph_module: torch.fx.GraphModule,
    edge_program,
    delegated: Callable[[torch.fx.Node], bool],
    decide: Callable[[torch.fx.Node], Decision],
) -> int:
    """Rewrite 1-D, non-transposed convolution_backward nodes in place; return how many.

    ``delegated``: whether the node goes to QNN (rules and skip options);
    ``decide``: the rules' decision, pinned on nodes that stay on CPU.
    """
    graph = graph_module.graph
    lifted = 0
    for node in list(graph.nodes):
        if not nodes.is_conv_bwd(node):
            continue
        if node.args[geo.GRAD_OUTPUT].meta["val"].dim() != 3 or node.args[geo.TRANSPOSED]:
            continue
        on_cpu = not delegated(node)
        reshapes = _Reshapes(node, on_cpu)
        grad_output, inp, weight = (node.args[i] for i in (geo.GRAD_OUTPUT, geo.INPUT, geo.WEIGHT))
        with graph.inserting_before(node):
            g4 = reshapes.unsqueeze(graph, grad_output, node)
            x4 = reshapes.unsqueeze(graph, inp, node)
            if on_cpu:
                weight4 = reshapes.unsqueeze(graph, weight, node)
        if not on_cpu and _bakeable(weight, edge_program):
            weight4 = _forward_weight(graph_module, weight, edge_program) or _register_weight(
                graph_module, weight, edge_program
            )
        elif not on_cpu:  # read at run time: the unit height is added in the graph
            with graph.inserting_before(node):
                weight4 = reshapes.unsqueeze(graph, weight, node)
        if on_cpu:
            node.meta[PINNED] = decide(node)
            node.meta[ON_CPU] = node.name

        args = list(node.args)
        args[geo.GRAD_OUTPUT], args[geo.INPUT], args[geo.WEIGHT] = g4, x4, weight4
        for index, unit in (
            (geo.STRIDE, 1),
            (geo.PADDING, 0),
            (geo.DILATION, 1),
            (geo.OUTPUT_PADDING, 0),
        ):
            args[index] = [unit, *node.args[index]]
        node.args = tuple(args)
        # grad_input and grad_weight gain the unit height; grad_bias is [C_out] as is.
        old_value = node.meta["val"]
        value = tuple(v.unsqueeze(2) if v is not None and v.dim() == 3 else v for v in old_value)
        node.meta["val"] = value

        # Every getitem right after the node, the squeezes after all of them: QNN
        # lists a delegate's outputs in the order their producers are built, and a
        # getitem output is built with the node itself (see split_gradients.py).
        items = sorted(
            (u for u in node.users if u.target == operator.getitem), key=lambda u: u.args[1]
        )
        cursor = node
        for item in items:
            cursor.append(item)
            item.meta["val"] = value[item.args[1]]
            cursor = item
        for item in items:
            index = item.args[1]
            if value[index].dim() != 4:
                continue
            users = list(item.users)
            with graph.inserting_after(cursor):
                cursor = reshapes.squeeze(graph, item, old_value[index], item)
            for user in users:
                user.replace_input_with(item, cursor)
        lifted += 1
    if lifted:
        graph_module.recompile()
    return lifted
