"""1-D convolution_backward as a 2-D one with a unit height.

executorch's CanonicalizeConv turns every 1-D ``convolution`` into
``unsqueeze -> conv2d -> squeeze`` and gives it a 4-D copy of the weight
(``[C_out, C_in/g, 1, k]``) as a ``get_attr`` buffer. This pass does the same for
``convolution_backward``: grad_output and input are unsqueezed at dim 2, the
node becomes 2-D (stride, padding, dilation get a leading 1 / 0 / 1) and every
gradient it returns is squeezed back. The weight is the forward convolution's
4-D buffer when a canonicalized forward convolution reads the same parameter,
so the forward and backward share one stored weight; otherwise a 4-D buffer of
its own is registered the way CanonicalizeConv does.

Runs after CanonicalizeConv, on nodes the support rules delegate; a 1-D node
that stays on CPU is left untouched.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch

from .. import integration
from ..builders import conv_geometry as geo


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


def _call(graph, target, args, value, like: torch.fx.Node):
    node = graph.create_node("call_function", target, args)
    node.meta.update({k: v for k, v in like.meta.items() if k not in ("val",)})
    node.meta["val"] = value
    return node


def lift_conv1d(
    graph_module: torch.fx.GraphModule,
    edge_program,
    delegated: Callable[[torch.fx.Node], bool],
) -> int:
    """Rewrite delegated 1-D convolution_backward nodes in place; return how many."""
    ops = integration.get("ops").edge.aten
    graph = graph_module.graph
    lifted = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != ops.convolution_backward.default:
            continue
        if node.args[geo.GRAD_OUTPUT].meta["val"].dim() != 3 or not delegated(node):
            continue
        grad_output, inp, weight = (node.args[i] for i in (geo.GRAD_OUTPUT, geo.INPUT, geo.WEIGHT))
        weight4 = _forward_weight(graph_module, weight, edge_program) or _register_weight(
            graph_module, weight, edge_program
        )
        with graph.inserting_before(node):
            g4 = _call(
                graph,
                ops.unsqueeze_copy.default,
                (grad_output, 2),
                grad_output.meta["val"].unsqueeze(2),
                node,
            )
            x4 = _call(
                graph, ops.unsqueeze_copy.default, (inp, 2), inp.meta["val"].unsqueeze(2), node
            )
            args = list(node.args)
            args[geo.GRAD_OUTPUT], args[geo.INPUT], args[geo.WEIGHT] = g4, x4, weight4
            for index, unit in (
                (geo.STRIDE, 1),
                (geo.PADDING, 0),
                (geo.DILATION, 1),
                (geo.OUTPUT_PADDING, 0),
            ):
                args[index] = [unit, *node.args[index]]
            # grad_input and grad_weight gain the unit height; grad_bias is [C_out] as is.
            value = tuple(
                v.unsqueeze(2) if v is not None and v.dim() == 3 else v for v in node.meta["val"]
            )
            node4 = _call(graph, node.target, tuple(args), value, node)
        # Every getitem right after the node, the squeezes after all of them: QNN
        # lists a delegate's outputs in the order their producers are built, and a
        # getitem output is built with the node itself (see split_gradients.py).
        users = sorted(
            (u for u in node.users if u.target == operator.getitem), key=lambda u: u.args[1]
        )
        cursor, items = node, []
        for user in users:
            index = user.args[1]
            with graph.inserting_after(cursor):
                cursor = _call(graph, operator.getitem, (node4, index), value[index], user)
            items.append((user, cursor))
        for user, item in items:
            result = item
            if value[user.args[1]].dim() == 4:
                with graph.inserting_after(cursor):
                    cursor = result = _call(
                        graph, ops.squeeze_copy.dims, (item, [2]), user.meta["val"], user
                    )
            user.replace_all_uses_with(result)
            graph.erase_node(user)
        graph.erase_node(node)
        lifted += 1
    if lifted:
        graph_module.recompile()
    return lifted
