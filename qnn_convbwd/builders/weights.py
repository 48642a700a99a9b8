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


def is_quantized_weight(weight_node: torch.fx.Node) -> bool:
    """A constant weight the QNN graph holds quantized (executorch's AnnotateQuantAttrs
    wrote the quantization of its dequantize on it): a pt2e-quantized convolution's."""
    return bool(weight_node.meta.get(integration.get("QCOM_QUANT_ATTRS")))


def filter_dtype(weight_node: torch.fx.Node) -> torch.dtype:
    """The dtype of the filters grad_input builds from a weight: float for a quantized
    weight, which reaches them dequantized."""
    return torch.float32 if is_quantized_weight(weight_node) else weight_node.meta["val"].dtype


def weight_scales(weight_node: torch.fx.Node) -> torch.Tensor:
    """A quantized weight's scale per output channel (one value repeated when the weight is
    quantized per tensor), from executorch's quantization metadata."""
    attrs = weight_node.meta[integration.get("QCOM_QUANT_ATTRS")]
    channels = int(weight_node.meta["val"].shape[0])
    if "scales" in attrs:
        return torch.as_tensor(attrs["scales"], dtype=torch.float32).reshape(channels)
    return torch.full((channels,), float(attrs["scale"]), dtype=torch.float32)


def _integer_static(visitor, name: str, integers, dims, nodes_to_wrappers):
    """A static int8 tensor holding ``integers`` quantized per tensor with scale 1 and
    offset 0: QNN's Dequantize of it gives the integers as float."""
    cached = nodes_to_wrappers.get(name, {}).get(0)
    if cached is not None:
        return cached
    get = integration.get
    encoding, config = visitor.make_qnn_per_tensor_config(
        {
            get("QCOM_DTYPE"): torch.int8,
            get("QCOM_SCALE"): 1.0,
            get("QCOM_ZERO_POINT"): 0,
            get("QCOM_QUANT_MIN"): -128,
            get("QCOM_QUANT_MAX"): 127,
        }
    )
    dtype = visitor.get_data_type(torch.empty(0, dtype=torch.int8), config)
    data = np.array([]) if integers is None else np.ascontiguousarray(integers)
    wrapper = get("TensorWrapper")(
        name,
        qnn_ops.adaptor_enum("Qnn_TensorType_t").QNN_TENSOR_TYPE_STATIC,
        dtype,
        encoding,
        config,
        len(dims),
        [int(d) for d in dims],
        [],
        data,
        integers is not None,
    )
    nodes_to_wrappers[name][0] = wrapper
    return wrapper


def dequantized_weight_hwio(visitor, weight_node: torch.fx.Node, build_node, nodes_to_wrappers):
    """``(ops, hwio)``: a quantized weight's float HWIO tensor for grad_input: QNN's
    Dequantize of its int8 integers (a static HWIO tensor quantized per tensor with scale
    1), times each output channel's scale (a static ``[O]`` float tensor). Built once per
    weight; the graph stores no float tensor of it (QAIRT folds the Dequantize of the
    static integers into a two-byte constant in the context binary, docs/quantized.md).

    The integers are a second static tensor, one byte an element, beside the
    per-channel quantized one the forward Conv2d reads: QNN refuses Dequantize and Cast
    of a per-channel tensor (measured, SM8650: "Op Dequantize does not support
    per-channel quant tensor", the same for Cast), so the forward's tensor cannot be
    read as float. (A Cast of the integers stored as an unsigned 8-bit static tensor, which
    the HTP validates, gave wrong gradients in the same measurement.)"""
    name = f"{weight_node.name}_convbwd_dequantized"
    cached = nodes_to_wrappers.get(name, {}).get(0)
    if cached is not None:
        return [], cached
    value = weight_node.meta["val"]
    spatial = value.dim() - 2
    hwio_shape = [int(value.shape[i]) for i in geo.oihw_to_hwio(spatial)]
    weight = integration.get("get_parameter")(weight_node, visitor.edge_program)
    if weight.dtype != torch.int8:
        raise geo.ConvArgumentError(f"{weight_node.name}: {weight.dtype} weight, not int8")
    integers = None
    if not isinstance(weight, FakeTensor):  # real data outside op validation
        integers = weight.permute(geo.oihw_to_hwio(spatial)).contiguous().numpy()
    stored = _integer_static(
        visitor, f"{name}_integers_stored", integers, hwio_shape, nodes_to_wrappers
    )
    scales = weight_scales(weight_node)
    scale_tensor = qnn_ops.static_tensor(
        f"{name}_scales",
        scales.reshape([1] * (spatial + 1) + [-1]).numpy(),
        [1] * (spatial + 1) + [int(scales.numel())],
        torch.float32,
        nodes_to_wrappers,
    )
    as_float = qnn_ops.native_tensor(
        visitor, f"{name}_integers", hwio_shape, torch.float32, nodes_to_wrappers
    )
    hwio = qnn_ops.native_tensor(visitor, name, hwio_shape, torch.float32, nodes_to_wrappers)
    ops = [
        qnn_ops.new_op(
            f"{name}_dequantize", integration.get("OpDequantize").op_name, [stored], [as_float]
        ),
        qnn_ops.new_op(
            f"{name}_scale",
            integration.get("OpElementWiseMultiply").op_name,
            [as_float, scale_tensor],
            [hwio],
        ),
    ]
    return ops, hwio


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
    # A quantized weight is dequantized in the graph, and dilated there after.
    quantized = is_quantized_weight(weight_node)
    shared_at_run_time = (
        run_time or quantized or runtime_tensors.made_at_run_time(weight_node, nodes_to_wrappers)
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
    if (run_time or quantized) and plan.dense_groups > 1:  # partition.support keeps it out
        raise geo.ConvArgumentError(
            f"{build_node.name}: a block-diagonal filter cannot be built from a run-time weight"
        )
    if run_time:
        ops, hwio = runtime_tensors.runtime_hwio(
            visitor, weight_node, build_node, nodes_to_wrappers
        )
    elif quantized:
        ops, hwio = dequantized_weight_hwio(visitor, weight_node, build_node, nodes_to_wrappers)
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
    hwoi = qnn_ops.native_tensor(
        visitor, name, hwoi_shape, filter_dtype(weight_node), nodes_to_wrappers
    )
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
    dtype = filter_dtype(weight_node)

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
