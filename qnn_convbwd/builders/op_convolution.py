"""The forward ``aten.convolution`` where its weight or bias is read at run time.

executorch's convolution visitor takes the weight and the bias only as static
tensors (it reads their values with ``get_parameter``). A trainable weight or
bias must reach the delegate at run time instead (``runtime_tensors``), so
this visitor builds the convolution itself when either operand is read at run
time: the filter is the run-time weight permuted to ``HWIO`` (shared with the
backward ops of the same weight), the bias the run-time tensor itself. A
frozen weight next to a trainable bias (bias-only fine-tuning) keeps its
static tensor, stored once, through the same path the backward ops use.

Everything else goes to executorch's visitor, after the selected grad_input
formulation's prelude (``input_gradient_runtime_weight.FORWARD_PRELUDES``).
"""

from __future__ import annotations

import torch

from .. import integration, options
from ..geometry import conv as geo
from . import input_gradient_runtime_weight, qnn_ops, runtime_tensors, weights


def _as_list(built) -> list:
    if built is None:
        return []
    return built if isinstance(built, list) else [built]


def _prelude(visitor, node: torch.fx.Node, nodes_to_wrappers) -> list:
    prelude = input_gradient_runtime_weight.FORWARD_PRELUDES.get(options.current.input_gradient)
    return [] if prelude is None else prelude(visitor, node, nodes_to_wrappers)


def define_convolution(original, visitor, node: torch.fx.Node, nodes_to_wrappers):
    """``integration.Hooks.conv_define``: executorch's visitor, or the run-time build."""
    runtime = [
        runtime_tensors.reads_at_run_time(visitor, node.args[i]) for i in (geo.F_WEIGHT, geo.F_BIAS)
    ]
    quant_key = integration.get("QCOM_QUANT_ATTRS")
    quantized = any(
        isinstance(n, torch.fx.Node) and n.meta.get(quant_key)
        for n in (node, node.args[geo.F_WEIGHT], node.args[geo.F_BIAS])
    )
    if quantized or not any(runtime):  # executorch's visitor encodes quantized operands
        ops = _prelude(visitor, node, nodes_to_wrappers)
        built = original()
        return built if not ops or built is None else [*ops, *_as_list(built)]
    return _build(visitor, node, nodes_to_wrappers, *runtime)


def _filter_order(spatial: int, transposed: bool) -> tuple[int, ...]:
    """Torch weight dims in the order of the QNN filter ``[*k, C_in(/g), C_out(/g)]``.

    A convolution's weight is OIHW (``geo.oihw_to_hwio``); a transposed
    convolution's is IOHW, whose C_in comes first.
    """
    if transposed:
        return (*range(2, 2 + spatial), 0, 1)
    return geo.oihw_to_hwio(spatial)


def _op_class(spatial: int, transposed: bool, depthwise: bool):
    if transposed:
        return integration.get("OpTransposeConv2d" if spatial == 2 else "OpTransposeConv3d")
    if depthwise:
        return integration.get("OpDepthWiseConv2d")
    return integration.get("OpConv2d" if spatial == 2 else "OpConv3d")


def _build(visitor, node: torch.fx.Node, nodes_to_wrappers, weight_runtime: bool, bias_runtime):
    native = qnn_ops.adaptor_enum("Qnn_TensorType_t").QNN_TENSOR_TYPE_NATIVE
    static = qnn_ops.adaptor_enum("Qnn_TensorType_t").QNN_TENSOR_TYPE_STATIC
    input_node = visitor.get_node(node.args[geo.F_INPUT])
    input_value = visitor.get_tensor(input_node, node)
    spatial = input_value.dim() - 2
    if spatial not in (2, 3):
        raise geo.ConvArgumentError(
            f"{node.name}: only 2-D and 3-D convolutions are built (1-D is lifted to 2-D first)"
        )
    transposed = bool(node.args[geo.F_TRANSPOSED])
    groups = int(node.args[geo.F_GROUPS])
    weight_node = visitor.get_node(node.args[geo.F_WEIGHT])
    ops: list = []
    if weight_runtime:
        filter_ops, conv_filter = runtime_tensors.runtime_filter(
            visitor, weight_node, node, _filter_order(spatial, transposed), nodes_to_wrappers
        )
        ops += filter_ops
    else:
        if transposed:
            raise geo.ConvArgumentError(
                f"{node.name}: a transposed convolution with a static weight and a run-time "
                "bias is not built here"
            )
        ops += _prelude(visitor, node, nodes_to_wrappers)
        conv_filter = weights.static_weight_hwio(visitor, weight_node, node, nodes_to_wrappers)
    inputs = [
        visitor.define_tensor(input_node, node, input_value, native, nodes_to_wrappers),
        conv_filter,
    ]
    if node.args[geo.F_BIAS] is not None:
        bias_node = visitor.get_node(node.args[geo.F_BIAS])
        if bias_runtime:
            bias, _ = runtime_tensors.runtime_tensor(visitor, bias_node, node, nodes_to_wrappers)
        else:
            value = integration.get("get_parameter")(bias_node, visitor.edge_program)
            bias = visitor.define_tensor(bias_node, node, value, static, nodes_to_wrappers)
        inputs.append(bias)
    output_value = visitor.get_tensor(node, node)
    output = visitor.define_tensor(node, node, output_value, native, nodes_to_wrappers)

    weight_shape = weight_node.meta["val"].shape
    filter_shape = [int(weight_shape[i]) for i in _filter_order(spatial, transposed)]
    group_in, group_out = filter_shape[-2], filter_shape[-1] // groups
    # executorch's own choice: a 2-D conv with one input channel per group is depthwise.
    depthwise = (
        not transposed and spatial == 2 and group_in == 1 and group_out % group_in == 0
    ) and groups > 2
    names = _op_class(spatial, transposed, depthwise)
    conv = qnn_ops.new_op(node.name, names.op_name, inputs, [output])
    qnn_ops.uint32_param(conv, names.param_stride, list(node.args[geo.F_STRIDE]))
    qnn_ops.uint32_param(conv, names.param_pad_amount, [[p, p] for p in node.args[geo.F_PADDING]])
    if transposed:
        if any(d != 1 for d in node.args[geo.F_DILATION]):
            raise geo.ConvArgumentError(f"{node.name}: TransposeConv has no dilation")
        qnn_ops.uint32_param(
            conv, names.param_output_padding, list(node.args[geo.F_OUTPUT_PADDING])
        )
    else:
        qnn_ops.uint32_param(conv, names.param_dilation, list(node.args[geo.F_DILATION]))
    if not depthwise:
        qnn_ops.uint32_scalar(conv, names.param_group, groups)
    return [*ops, conv]
