"""The static convolution weight, shared between the forward and backward ops.

executorch's forward Conv2d visitor defines the weight as a static tensor named
after the weight node, in HWIO layout, and caches the wrapper by that name. The
backward visitors ask for the same name and layout, so they receive the very
same wrapper: the weight's bytes enter the QNN graph once. Any other layout
(HWOI for TransposeConv2d) is a data-less tensor produced by a Transpose op,
built once per weight and shared by every backward node that reads it.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensor

from .. import integration
from . import conv_geometry as geo
from . import qnn_ops


@dataclasses.dataclass
class WeightTensors:
    hwio: object  # static wrapper shared with the forward Conv2d
    hwoi: object  # native wrapper produced by ``transpose`` (or by an earlier node)
    transpose: object | None  # the Transpose op to emit, None when already emitted


def static_weight_hwio(visitor, weight_node: torch.fx.Node, build_node, nodes_to_wrappers):
    """The weight's static HWIO wrapper, identical to the one the forward Conv2d defines."""
    weight = integration.get("get_parameter")(weight_node, visitor.edge_program)
    return visitor.define_tensor(
        weight_node,
        build_node,
        weight.permute(geo.OIHW_TO_HWIO).contiguous(),
        integration.get("Qnn_TensorType_t").QNN_TENSOR_TYPE_STATIC,
        nodes_to_wrappers,
    )


def hwoi_name(weight_node: torch.fx.Node) -> str:
    return f"{weight_node.name}_convbwd_hwoi"


def dilated_hwoi(
    visitor, weight_node: torch.fx.Node, build_node, dilation, nodes_to_wrappers
) -> WeightTensors:
    """A static HWOI filter with the kernel dilated (zeros between the taps).

    TransposeConv2d has no dilation parameter; a dilated transposed convolution
    is the undilated one with this kernel. It is a second static tensor: the
    weight is stored twice (and larger) for dilated convolutions.
    """
    name = f"{hwoi_name(weight_node)}_dilated_{'x'.join(map(str, dilation))}"
    weight = integration.get("get_parameter")(weight_node, visitor.edge_program)
    out_c, in_c, *kernel = weight.shape
    size = [d * (k - 1) + 1 for d, k in zip(dilation, kernel, strict=True)]
    oihw = [out_c, in_c, *size]
    hwoi_dims = [[oihw[i] for i in geo.OIHW_TO_HWIO][j] for j in geo.HWIO_TO_HWOI]
    hwoi = None
    if not isinstance(weight, FakeTensor):  # real data outside op validation
        dilated = np.zeros(oihw, dtype=weight.detach().numpy().dtype)
        dilated[:, :, :: dilation[0], :: dilation[1]] = weight.detach().numpy()
        hwoi = dilated.transpose(geo.OIHW_TO_HWIO).transpose(geo.HWIO_TO_HWOI)
    tensor = qnn_ops.static_tensor(name, hwoi, hwoi_dims, weight.dtype, nodes_to_wrappers)
    return WeightTensors(None, tensor, None)


def weight_for_input_gradient(
    visitor, weight_node: torch.fx.Node, build_node: torch.fx.Node, nodes_to_wrappers
) -> WeightTensors:
    conv = geo.parse(build_node)
    if any(d != 1 for d in conv.dilation):
        return dilated_hwoi(visitor, weight_node, build_node, conv.dilation, nodes_to_wrappers)
    hwio = static_weight_hwio(visitor, weight_node, build_node, nodes_to_wrappers)
    name = hwoi_name(weight_node)
    cached = nodes_to_wrappers.get(name, {}).get(0)
    if cached is not None:
        return WeightTensors(hwio, cached, None)
    weight = integration.get("get_parameter")(weight_node, visitor.edge_program)
    hwio_shape = [weight.shape[i] for i in geo.OIHW_TO_HWIO]
    hwoi_shape = [hwio_shape[i] for i in geo.HWIO_TO_HWOI]
    hwoi = qnn_ops.native_tensor(visitor, name, hwoi_shape, weight.dtype, nodes_to_wrappers)
    op_names = integration.get("OpTranspose")
    transpose = qnn_ops.new_op(f"{name}_transpose", op_names.op_name, [hwio], [hwoi])
    qnn_ops.uint32_param(transpose, op_names.param_perm, geo.HWIO_TO_HWOI)
    return WeightTensors(hwio, hwoi, transpose)
