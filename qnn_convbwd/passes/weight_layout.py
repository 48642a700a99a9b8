"""Trainable convolution weights enter and leave a delegate in the QNN filter layout.

A trainable weight is a run-time input of the delegate, and QAIRT finalises ops
on a large run-time tensor whose last dim is small (torch's ``OIHW`` weight
``[O, I, kH, kW]``) very slowly: measured, a delegate scaling one 512x512x3x3
input took 30 s to finalise, the same elements as ``HWIO`` ``[3, 3, 512, 512]``
under 0.1 s (docs/lowering_time.md). With ``Options.weight_layout == "hwio"``
``MoveWeightLayouts`` rewrites, for each trainable parameter read only as the
weight of non-transposed convolutions and convolution_backwards::

    w -> conv / convolution_backward(weight=w) -> getitem 1 (grad_weight)

into::

    w -> permute OIHW->HWIO (CPU, WEIGHT_TO_DEVICE)
      -> permute HWIO->OIHW (WEIGHT_VIEW, one per reader) -> conv / convolution_backward
         -> getitem 1 -> permute OIHW->HWIO (GRAD_VIEW)
      -> permute HWIO->OIHW (CPU, GRAD_TO_TORCH) -> the gradient's readers

The partitioner keeps the outer permutes on CPU and delegates the inner ones
with their convolutions (``partition.judge``); inside the delegate the
visitors fold them away: the convolutions read the ``HWIO`` input as their
filter (``builders.runtime_tensors``), and grad_weight is computed straight
into the ``HWIO`` output (``builders.op_convolution_backward``). The program's
parameters and gradients keep torch's layout; the permutes are exact.

Runs after the other transform passes (a ``late`` stage of ``pipeline.py``):
the canonicalisation folds consecutive permutes, which would undo the pairs.
"""

from __future__ import annotations

import logging

import torch

from .. import integration, nodes, signature
from ..geometry import conv as geo
from ..meta import (
    GRAD_TO_TORCH,
    GRAD_VIEW,
    STORED_FILTER,
    UNSCALE,
    WEIGHT_TO_DEVICE,
    WEIGHT_VIEW,
)
from .gated import OptionGatedPass

logger = logging.getLogger(__name__)


def inverse(perm: tuple[int, ...]) -> tuple[int, ...]:
    """The permutation undoing ``perm``."""
    result = [0] * len(perm)
    for position, dim in enumerate(perm):
        result[dim] = position
    return tuple(result)


def _read_as_weight_only(node: torch.fx.Node) -> bool:
    """Every use of ``node`` is the weight of a non-transposed convolution or
    convolution_backward."""
    uses = [(user, i) for user in node.users for i, arg in enumerate(user.args) if arg is node]

    def as_weight(user: torch.fx.Node, index: int) -> bool:
        if nodes.is_convolution(user):
            return index == nodes.CONV_WEIGHT and not user.args[nodes.CONV_TRANSPOSED]
        if nodes.is_conv_bwd(user):
            return index == nodes.CONV_BWD_WEIGHT and not user.args[geo.TRANSPOSED]
        return False

    return bool(uses) and all(as_weight(user, i) for user, i in uses)


def _permute(graph: torch.fx.Graph, source: torch.fx.Node, perm, key: str, weight: str):
    node = graph.create_node(
        "call_function", integration.get("ops").edge.aten.permute_copy.default, (source, perm)
    )
    node.meta["val"] = source.meta["val"].permute(perm).contiguous()
    node.meta[key] = weight
    return node


def _weight_gradients(graph: torch.fx.Graph, edge_program) -> dict[str, torch.fx.Node]:
    """Parameter placeholder name -> the convolution_backward's grad_weight (getitem 1)
    that is the parameter's gradient output (through its loss-scale unscaling).

    Found from the output signature: the convolution_backward computing grad_weight
    may not read the weight itself (``passes.shape_only_operands``)."""
    signature_ = edge_program.graph_signature
    placeholders = {fqn: name for name, fqn in signature_.inputs_to_parameters.items()}
    results = graph.output_node().args[0]
    found = {}
    for spec, value in zip(signature_.output_specs, results):
        if spec.kind.name != "GRADIENT_TO_PARAMETER" or spec.target not in placeholders:
            continue
        if isinstance(value, torch.fx.Node) and value.meta.get(UNSCALE):
            value = value.args[0]
        if nodes.is_getitem_of(value, nodes.is_conv_bwd) and value.args[1] == 1:
            found[placeholders[spec.target]] = value
    return found


def _mark_stored_views(graph: torch.fx.Graph) -> int:
    """Make the permutes ``passes.filter_storage`` put between a weight the program
    stores in the filter layout and its convolutions (and of its gradient back to the
    filter layout) the views the visitors fold; return how many weights."""
    permute = integration.get("ops").edge.aten.permute_copy.default
    weights = set()
    for node in graph.nodes:
        tag = node.meta.get("custom", {}).get(STORED_FILTER)
        if not tag or not nodes.is_call(node, permute):
            continue
        if "weight" in tag and node.args[0].op == "placeholder":
            node.meta[WEIGHT_VIEW] = node.args[0].name
            weights.add(tag["weight"])
        elif "gradient" in tag and nodes.is_getitem_of(node.args[0], nodes.is_conv_bwd):
            node.meta[GRAD_VIEW] = tag["gradient"]
    return len(weights)


def move_weight_layouts(graph_module: torch.fx.GraphModule, edge_program) -> int:
    """Rewrite in place; return how many weights now enter the delegate as ``HWIO``."""
    graph = graph_module.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    gradients = _weight_gradients(graph, edge_program)
    moved = _mark_stored_views(graph)
    for weight in [n for n in graph.nodes if n.op == "placeholder"]:
        if not signature.is_trainable_parameter(weight, edge_program):
            continue
        value = weight.meta.get("val")
        if value is None or value.dim() not in (4, 5) or not _read_as_weight_only(weight):
            continue
        to_filter = geo.oihw_to_hwio(value.dim() - 2)
        readers = sorted(weight.users, key=order.__getitem__)
        with graph.inserting_before(readers[0]):
            to_device = _permute(graph, weight, to_filter, WEIGHT_TO_DEVICE, weight.name)
        for reader in readers:
            # One view per reader: readers in different delegates each get the HWIO input.
            with graph.inserting_before(reader):
                view = _permute(graph, to_device, inverse(to_filter), WEIGHT_VIEW, weight.name)
            reader.replace_input_with(weight, view)
        item = gradients.get(weight.name)
        if item is not None:
            grad_readers = list(item.users)
            with graph.inserting_after(item):
                grad_view = _permute(graph, item, to_filter, GRAD_VIEW, weight.name)
            with graph.inserting_after(grad_view):
                back = _permute(graph, grad_view, inverse(to_filter), GRAD_TO_TORCH, weight.name)
            for grad_reader in grad_readers:
                grad_reader.replace_input_with(item, back)
        moved += 1
    if moved:
        graph_module.recompile()
        logger.info("weight_layout: %d trainable weights enter the delegate as HWIO", moved)
    return moved


class MoveWeightLayouts(OptionGatedPass):
    """to_edge transform pass running ``move_weight_layouts`` when ``weight_layout == "hwio"``."""

    def enabled(self, options) -> bool:
        return options.weight_layout == "hwio" and self.edge_program is not None

    def rewrite(self, graph_module: torch.fx.GraphModule) -> int:
        return move_weight_layouts(graph_module, self.edge_program)
