"""The static convolution weight, shared between the forward and backward ops.

executorch's forward convolution visitor defines the weight as a static tensor
named after the weight node, in HWIO layout, and caches the wrapper by that
name. The backward visitors ask for the same name and layout, so they receive
the very same wrapper: the weight's bytes enter the QNN graph once. Any other
layout (HWOI for TransposeConv) is a data-less tensor produced by a Transpose
op, built once per weight and shared by every backward node that reads it.
Layout names: ``geometry.conv`` (they cover 2-D and 3-D kernels).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensor

from .. import integration
from ..geometry import conv as geo
from . import qnn_ops, runtime_tensors


@dataclasses.dataclass
class WeightTensors:
    hwio: object  # wrapper shared with the forward convolution (static, or run time)
    hwoi: object  # native wrapper produced by ``ops`` (or by an earlier node)
    ops: list  # the ops to emit that make ``hwoi`` (empty when already emitted)


def static_weight_hwio(visitor, weight_node: torch.fx.Node, build_node, nodes_to_wrappers):
    """The weight's static HWIO wrapper, identical to the one the forward convolution defines."""
    weight = integration.get("get_parameter")(weight_node, visitor.edge_program)
    return visitor.define_tensor(
        weight_node,
        build_node,
        weight.permute(geo.oihw_to_hwio(weight.dim() - 2)).contiguous(),
        integration.get("Qnn_TensorType_t").QNN_TENSOR_TYPE_STATIC,
        nodes_to_wrappers,
    )


def hwoi_name(weight_node: torch.fx.Node, order: Sequence[int] = ()) -> str:
    """Name of the HWOI filter; ``order`` (spatial dims reordered) other than the identity
    is part of it."""
    name = f"{weight_node.name}_convbwd_hwoi"
    if list(order) != sorted(order):
        name += "_order" + "".join(map(str, order))
    return name


def _order_kernel(order: Sequence[int], spatial: int) -> tuple[int, ...]:
    """Permutation of an HWOI filter taking its kernel dims in ``order``."""
    return (*(order or range(spatial)), spatial, spatial + 1)


def expanded_hwoi(
    visitor,
    weight_node: torch.fx.Node,
    build_node,
    dilation,
    dense_groups: int,
    order: Sequence[int],
    nodes_to_wrappers,
) -> WeightTensors:
    """A static HWOI filter with the kernel dilated and/or the groups made dense.

    TransposeConv has no dilation parameter: a dilated transposed convolution
    is the undilated one with zeros between the kernel taps. Where the op
    ignores its group parameter (``geo.transpose_conv_applies_groups``), the
    grouped weight ``[C_out, C_in/g, *k]`` becomes the dense ``[C_out, C_in, *k]``
    that is zero outside each output channel's group. Either way this is a second
    static tensor: the weight is stored twice, and larger. Its kernel dims are
    taken in ``order`` (see ``geo.transpose_conv_spatial_order``).
    """
    suffix = [f"dilated_{'x'.join(map(str, dilation))}"] if any(d != 1 for d in dilation) else []
    suffix += [f"dense_{dense_groups}"] if dense_groups > 1 else []
    name = "_".join([hwoi_name(weight_node, order), *suffix])
    weight = integration.get("get_parameter")(weight_node, visitor.edge_program)
    out_c, in_g, *kernel = weight.shape
    spatial = len(kernel)
    size = [d * (k - 1) + 1 for d, k in zip(dilation, kernel, strict=True)]
    oihw = [out_c, in_g * dense_groups, *size]
    reorder = _order_kernel(order, spatial)
    hwoi_dims = [[oihw[i] for i in geo.oihw_to_hwio(spatial)][j] for j in geo.hwio_to_hwoi(spatial)]
    hwoi_dims = [hwoi_dims[i] for i in reorder]
    hwoi = None
    if not isinstance(weight, FakeTensor):  # real data outside op validation
        expanded = np.zeros(oihw, dtype=weight.detach().numpy().dtype)
        taps = tuple(slice(None, None, d) for d in dilation)
        per_group = out_c // dense_groups
        for g in range(dense_groups):
            rows = slice(g * per_group, (g + 1) * per_group)
            cols = slice(g * in_g, (g + 1) * in_g)
            expanded[(rows, cols, *taps)] = weight.detach().numpy()[rows]
        hwoi = (
            expanded.transpose(geo.oihw_to_hwio(spatial))
            .transpose(geo.hwio_to_hwoi(spatial))
            .transpose(reorder)
        )
    tensor = qnn_ops.static_tensor(name, hwoi, hwoi_dims, weight.dtype, nodes_to_wrappers)
    return WeightTensors(None, tensor, [])


def weight_for_input_gradient(
    visitor,
    weight_node: torch.fx.Node,
    build_node: torch.fx.Node,
    plan: geo.TransposedConvPlan,
    order: Sequence[int],
    nodes_to_wrappers,
) -> WeightTensors:
    """The HWOI filter of grad_input's TransposeConv, following ``plan``, with its
    kernel dims in ``order``."""
    conv = geo.parse(build_node)
    run_time = runtime_tensors.reads_at_run_time(visitor, weight_node)
    # A frozen weight the runtime_weight prelude made run-time is dilated in the graph
    # too: no static dilated copy (a block-diagonal filter is not: ``not_applicable``).
    shared_at_run_time = run_time or runtime_tensors.made_at_run_time(
        weight_node, nodes_to_wrappers
    )
    if geo.own_filter_reason(conv) is not None and not shared_at_run_time:
        return expanded_hwoi(
            visitor,
            weight_node,
            build_node,
            conv.dilation,
            plan.dense_groups,
            order,
            nodes_to_wrappers,
        )
    if run_time:
        if plan.dense_groups > 1:  # partition.support keeps it from the visitor
            raise geo.ConvArgumentError(
                f"{build_node.name}: a block-diagonal filter cannot be built from a run-time weight"
            )
        ops, hwio = runtime_tensors.runtime_hwio(
            visitor, weight_node, build_node, nodes_to_wrappers
        )
    else:
        ops, hwio = [], static_weight_hwio(visitor, weight_node, build_node, nodes_to_wrappers)
    plain = _hwoi_from(visitor, weight_node, hwio, ops, order, nodes_to_wrappers)
    if any(d != 1 for d in conv.dilation):
        return _dilated_in_graph(
            visitor, weight_node, plain, conv.dilation, order, nodes_to_wrappers
        )
    return plain


def _hwoi_from(visitor, weight_node, hwio, ops: list, order, nodes_to_wrappers) -> WeightTensors:
    """HWIO -> HWOI (kernel dims in ``order``): one Transpose, built once per weight."""
    name = hwoi_name(weight_node, order)
    cached = nodes_to_wrappers.get(name, {}).get(0)
    if cached is not None:
        return WeightTensors(hwio, cached, ops)
    weight = weight_node.meta["val"]
    spatial = weight.dim() - 2
    hwio_shape = [int(weight.shape[i]) for i in geo.oihw_to_hwio(spatial)]
    perm = [geo.hwio_to_hwoi(spatial)[i] for i in _order_kernel(order, spatial)]
    hwoi_shape = [hwio_shape[i] for i in perm]
    hwoi = qnn_ops.native_tensor(visitor, name, hwoi_shape, weight.dtype, nodes_to_wrappers)
    return WeightTensors(
        hwio, hwoi, [*ops, qnn_ops.transpose(f"{name}_transpose", hwio, hwoi, perm)]
    )


def _dilated_in_graph(
    visitor,
    weight_node: torch.fx.Node,
    plain: WeightTensors,
    dilation: Sequence[int],
    order: Sequence[int],
    nodes_to_wrappers,
) -> WeightTensors:
    """The dilated HWOI filter of a weight read at run time, computed in the graph.

    TransposeConv has no dilation: the kernel gets ``d - 1`` zeros between its
    taps. From the HWOI filter ``[*k, O, I]``: a Reshape to ``[1, *k, O * I]``
    (the kernel dims as the spatial dims of an activation), ``qnn_ops.zero_insert``
    by the dilation (each tap followed by ``d - 1`` zeros), a StridedSlice that
    drops the zeros after the last tap, and a Reshape to ``[*k', O, I]`` with
    ``k' = d * (k - 1) + 1``. Nothing is stored.
    """
    value = weight_node.meta["val"]
    spatial = value.dim() - 2
    dims = list(order) if order else list(range(spatial))
    kernel = [int(value.shape[2 + i]) for i in dims]
    factors = [int(dilation[i]) for i in dims]
    name = f"{hwoi_name(weight_node, order)}_dilated_{'x'.join(map(str, factors))}"
    cached = nodes_to_wrappers.get(name, {}).get(0)
    if cached is not None:
        return WeightTensors(plain.hwio, cached, plain.ops)
    channels = int(value.shape[0]) * int(value.shape[1])
    dtype = value.dtype

    def tensor(suffix: str, shape):
        return qnn_ops.native_tensor(visitor, f"{name}_{suffix}", shape, dtype, nodes_to_wrappers)

    flat = tensor("flat", [1, *kernel, channels])
    ops = [*plain.ops, qnn_ops.reshape(f"{name}_flat_op", plain.hwoi, flat)]
    inserted, spread, spread_shape = qnn_ops.zero_insert(
        visitor, f"{name}_insert", flat, [1, *kernel, channels], factors, dtype, nodes_to_wrappers
    )
    ops += inserted
    size = [f * (k - 1) + 1 for f, k in zip(factors, kernel, strict=True)]
    cropped = tensor("cropped", [1, *size, channels])
    ranges = [[0, 1, 1], *([0, n, 1] for n in size), [0, spread_shape[-1], 1]]
    ops.append(qnn_ops.strided_slice(f"{name}_crop", spread, cropped, ranges))
    out_c, in_g = int(value.shape[0]), int(value.shape[1])
    hwoi = qnn_ops.native_tensor(visitor, name, [*size, out_c, in_g], dtype, nodes_to_wrappers)
    ops.append(qnn_ops.reshape(f"{name}_op", cropped, hwoi))
    return WeightTensors(plain.hwio, hwoi, ops)
