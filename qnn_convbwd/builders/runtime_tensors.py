"""Weights and biases the QNN graph reads at run time instead of as static tensors.

A convolution's weight is read at run time when it is not a constant of the
program being compiled: a trainable parameter (``qnn_convbwd.signature``: the
partitioner keeps those top-level, so inside the delegate they are graph
inputs), or any other tensor a user feeds or a node computes. Such a weight
enters the QNN graph in torch's layout (``OIHW``, or ``IOHW`` for a transposed
convolution) and one Transpose makes the ``HWIO`` filter the Conv ops take.
With ``Options.weight_layout == "hwio"`` a trainable weight enters as the
HWIO filter itself (``passes.weight_layout``; the permute back to torch's layout
in front of the convolutions is not built, ``weight_views``) and no Transpose
is needed. That HWIO tensor is cached by name, so the forward convolution and the
backward ops of the same weight read one tensor and the Transpose is built
once per graph (by whichever reader is built first).

While executorch's partitioner validates ops, the program is the top-level
one, where a trainable weight is still a parameter: it is declared here as an
input tensor without data, so validation sees the graph the compiler will get.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import integration, signature
from ..geometry import conv as geo
from . import qnn_ops, weight_views


def reads_at_run_time(visitor, node: object) -> bool:
    """Whether ``node`` (a weight or bias operand) is not a static tensor of the QNN graph."""
    if not isinstance(node, torch.fx.Node):
        return False
    if not integration.get("is_parameter")(node, visitor.edge_program):
        return True
    return signature.is_trainable_parameter(node, visitor.edge_program)


# The ``runtime_weight`` prelude's tensors are named ``<weight>_runtime_<part>``; its
# ``PRELUDE_OUTPUT`` part exists once the prelude has made the weight's HWIO a run-time
# tensor in this graph.
PRELUDE_OUTPUT = "tail_scaled"


def prelude_prefix(weight_node: torch.fx.Node) -> str:
    return f"{weight_node.name}_runtime"


def made_at_run_time(weight_node: torch.fx.Node, nodes_to_wrappers) -> bool:
    """Whether the ``runtime_weight`` prelude turned this static weight into a run-time
    HWIO tensor of the graph (cached under the weight's own name)."""
    name = f"{prelude_prefix(weight_node)}_{PRELUDE_OUTPUT}"
    return nodes_to_wrappers.get(name, {}).get(0) is not None


def _physical_order(node: torch.fx.Node) -> tuple[int, ...]:
    """Torch dims of ``node``'s value in the order its QNN tensor holds them."""
    value = node.meta["val"]
    if node.meta.get(integration.get("QCOM_INSERTED_PERMUTE")):
        # A permute executorch's LayoutTransform put in front of a layout-sensitive
        # op: its value keeps the unpermuted shape, its output is permuted.
        return tuple(node.args[1])
    order = node.meta.get(integration.get("QCOM_AXIS_ORDER"))
    if order is None or value.dim() <= 1:
        return tuple(range(value.dim()))
    return tuple(order)


def runtime_tensor(visitor, node: torch.fx.Node, build_node: torch.fx.Node, nodes_to_wrappers):
    """The QNN tensor of a run-time operand, and the torch dims it holds in order."""
    if weight_views.folded_weight_view(node):
        # The permute is not built: its source holds the same elements.
        source, source_order = runtime_tensor(visitor, node.args[0], build_node, nodes_to_wrappers)
        perm = list(node.args[1])
        source_dims = [perm.index(d) for d in range(len(perm))]  # source dim -> node dim
        return source, tuple(source_dims[d] for d in source_order)
    value = node.meta["val"]
    order = _physical_order(node)
    physical = [int(value.shape[i]) for i in order] or [1]
    if integration.get("is_parameter")(node, visitor.edge_program):
        # A trainable parameter while the partitioner validates: the compiled graph
        # gets it as an input, so declare it as one (no data).
        app_write = qnn_ops.adaptor_enum("Qnn_TensorType_t").QNN_TENSOR_TYPE_APP_WRITE
        wrapper = qnn_ops.declared_tensor(
            visitor, node.name, physical, value.dtype, nodes_to_wrappers, app_write
        )
        return wrapper, order
    native = qnn_ops.adaptor_enum("Qnn_TensorType_t").QNN_TENSOR_TYPE_NATIVE
    shaped = value.permute(order) if value.dim() > 1 else value
    return visitor.define_tensor(node, build_node, shaped, native, nodes_to_wrappers), order


def filter_name(weight_node: torch.fx.Node, filter_order: Sequence[int]) -> str:
    return f"{weight_node.name}_convbwd_filter_{''.join(map(str, filter_order))}"


def runtime_filter(
    visitor,
    weight_node: torch.fx.Node,
    build_node: torch.fx.Node,
    filter_order: Sequence[int],
    nodes_to_wrappers,
) -> tuple[list, object]:
    """``(ops, filter)``: the run-time weight permuted to ``filter_order`` (torch dims).

    ``filter_order`` is ``geo.oihw_to_hwio(spatial)`` for a convolution's HWIO
    filter. The filter is cached under ``filter_name``; ops is empty when an
    earlier reader built it or the run-time tensor is the filter already.
    """
    name = filter_name(weight_node, filter_order)
    cached = nodes_to_wrappers.get(name, {}).get(0)
    if cached is not None:
        return [], cached
    source, order = runtime_tensor(visitor, weight_node, build_node, nodes_to_wrappers)
    value = weight_node.meta["val"]
    perm = [order.index(dim) for dim in filter_order]
    shape = [int(value.shape[dim]) for dim in filter_order]
    if tuple(order) == tuple(filter_order):
        # The run-time tensor is the filter already (a weight entering as HWIO).
        nodes_to_wrappers.setdefault(name, {})[0] = source
        return [], source
    result = qnn_ops.native_tensor(visitor, name, shape, value.dtype, nodes_to_wrappers)
    if perm == sorted(perm):
        return [qnn_ops.reshape(f"{name}_op", source, result)], result
    return [qnn_ops.transpose(f"{name}_op", source, result, perm)], result


def runtime_hwio(visitor, weight_node, build_node, nodes_to_wrappers) -> tuple[list, object]:
    """``(ops, HWIO filter)`` of a convolution weight read at run time."""
    spatial = weight_node.meta["val"].dim() - 2
    return runtime_filter(
        visitor, weight_node, build_node, geo.oihw_to_hwio(spatial), nodes_to_wrappers
    )
