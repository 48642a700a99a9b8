"""grad_weight and grad_bias of a 2-D or 3-D convolution on QNN.

grad_weight is itself a convolution, with the roles of the operands exchanged::

    gw[o, i, a, b] = sum_{n, y, x} g[n, o, y, x] * xp[n, g*Cg + i, y*s + a*d, x*s + b*d]

(xp: the input zero-padded by p; o in group g; Cg = C_in / groups). Read the
input with batch and channels swapped, I[i, h, w, (g, n)] = xp[n, g*Cg + i, h, w],
and grad_output as a filter F[y, x, n, o] = g[n, o, y, x]: a grouped Conv2d of I
with F, stride d, dilation s and the forward padding yields
``[Cg, kH', kW', C_out]`` (kH' >= kH; the excess is sliced off), which is
grad_weight in HWIO order up to one Transpose to torch's OIHW. The same holds
per spatial dim for a 3-D convolution (Conv3d, NDHWC; the index lists below are
built over the spatial dims).

A pointwise convolution (``ConvBackward.is_pointwise``: one-tap kernel, no
padding, one group) is the exception: its grad_weight is one MatMul of the
flattened input and grad_output (``_pointwise_weight_gradient``), the same
multiply-adds without a run-time filter.

The filter is a runtime tensor (it is grad_output), which the HTP accepts for
Conv2d and Conv3d. Alternatives considered: a MatMul over im2col patches needs the patch
extraction as many StridedSlice/Concat ops (one per kernel tap) and a
``C_in*k*k``-wide intermediate; the convolution does the same reduction in one
op on the HMX path.

grad_bias is a ReduceSum of grad_output over batch and spatial dims.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .. import integration
from ..geometry import conv as geo
from . import qnn_ops


def _transpose(name: str, source, shape: Sequence[int], perm: Sequence[int], dtype, visitor, n2w):
    out_shape = [shape[i] for i in perm]
    result = qnn_ops.native_tensor(visitor, name, out_shape, dtype, n2w)
    return qnn_ops.transpose(f"{name}_op", source, result, perm), result, out_shape


def _reshape(name: str, source, shape: Sequence[int], dtype, visitor, n2w):
    result = qnn_ops.native_tensor(visitor, name, shape, dtype, n2w)
    return qnn_ops.reshape(f"{name}_op", source, result), result


def _stuff_zeros(name: str, source, shape, factors, dtype, visitor, n2w) -> tuple[list, object]:
    """Insert ``f - 1`` zeros between the elements of each leading dim of ``source``.

    ``shape`` is ``[*spatial, ...]``, ``factors`` one per spatial dim. One dim at
    a time, with the dims before and after it merged (QNN ops take at most rank
    5): ``[A, o, B] -> [A, o, 1, B] -Pad-> [A, o, f, B] -> [A, o f, B]``, then the
    trailing ``f - 1`` zeros are sliced off.
    """
    ops, current, shape = [], source, list(shape)
    for dim, factor in enumerate(factors):
        if factor == 1:
            continue
        before, size, after = math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1 :])
        step = f"{name}_stuff{dim}"
        op, unit = _reshape(f"{step}_unit", current, [before, size, 1, after], dtype, visitor, n2w)
        ops.append(op)
        padded = qnn_ops.native_tensor(
            visitor, f"{step}_padded", [before, size, factor, after], dtype, n2w
        )
        ops.append(qnn_ops.zero_pad_end(f"{step}_pad", unit, padded, (0, factor - 1)))
        op, flat = _reshape(
            f"{step}_flat", padded, [before, size * factor, after], dtype, visitor, n2w
        )
        ops.append(op)
        shape[dim] = (size - 1) * factor + 1
        trimmed = qnn_ops.native_tensor(
            visitor, f"{step}_trimmed", [before, shape[dim], after], dtype, n2w
        )
        ops.append(
            qnn_ops.strided_slice(
                f"{step}_trim", flat, trimmed, [[0, before, 1], [0, shape[dim], 1], [0, after, 1]]
            )
        )
        current = trimmed
    op, result = _reshape(f"{name}_stuffed", current, shape, dtype, visitor, n2w)
    return [*ops, op], result


def _pointwise_weight_gradient(
    visitor,
    node: torch.fx.Node,
    conv: geo.ConvBackward,
    x,
    x_shape: Sequence[int],  # NHWC
    grad_output,
    grad_output_shape: Sequence[int],  # NHWC
    result,
    nodes_to_wrappers,
    result_order: Sequence[int],
) -> list:
    """grad_weight of a ``conv.is_pointwise`` convolution as one MatMul.

    With a one-tap kernel and no padding, ``gw[o, i] = sum_{n, y} g[n, o, y] *
    x[n, i, y * s]``: the input read at every s-th element (a StridedSlice where
    some stride is > 1) and grad_output, each flattened to ``[M, C]`` with
    ``M = N * prod(out)``, multiplied with the first operand transposed. The
    operands are taken in the order in which the result holds O and I, so a
    Reshape (the kernel dims are 1) writes it.
    """
    dtype = conv.dtype
    base = f"{node.name}_gw"
    n, *spatial, cin = (int(v) for v in x_shape)
    out = [int(v) for v in grad_output_shape[1:-1]]
    ops = []
    if any(s > 1 for s in conv.stride):
        ranges = [[0, n, 1], *([0, i, s] for i, s in zip(spatial, conv.stride)), [0, cin, 1]]
        sampled = qnn_ops.native_tensor(
            visitor, f"{base}_sampled", [n, *out, cin], dtype, nodes_to_wrappers
        )
        ops.append(qnn_ops.strided_slice(f"{base}_sample", x, sampled, ranges))
        x = sampled
    rows = n * math.prod(out)
    op, x2d = _reshape(f"{base}_x2d", x, [rows, cin], dtype, visitor, nodes_to_wrappers)
    ops.append(op)
    op, g2d = _reshape(
        f"{base}_g2d", grad_output, [rows, conv.out_channels], dtype, visitor, nodes_to_wrappers
    )
    ops.append(op)
    # OIHW dim 0 is O, dim 1 is I.
    if result_order.index(0) < result_order.index(1):
        operands, shape = [g2d, x2d], [conv.out_channels, cin]
    else:
        operands, shape = [x2d, g2d], [cin, conv.out_channels]
    product = qnn_ops.native_tensor(visitor, f"{base}_product", shape, dtype, nodes_to_wrappers)
    names = integration.get("OpMatMul")
    matmul = qnn_ops.new_op(f"{base}_matmul", names.op_name, operands, [product])
    qnn_ops.bool_scalar(matmul, names.param_transpose_in0, True)
    qnn_ops.bool_scalar(matmul, names.param_transpose_in1, False)
    ops.append(matmul)
    ops.append(qnn_ops.reshape(f"{base}_result", product, result))
    return ops


# QNN's convolution for each number of spatial dims (1-D is lifted to 2-D).
_CONV_OPS = {2: "OpConv2d", 3: "OpConv3d"}


def weight_gradient(
    visitor,
    node: torch.fx.Node,
    conv: geo.ConvBackward,
    grad_output,
    grad_output_shape: Sequence[int],  # NHWC
    result,
    nodes_to_wrappers,
    result_order: Sequence[int] | None = None,
) -> list:
    """Ops computing grad_weight for a 2-D or 3-D convolution into ``result``, which
    holds the dims of torch's OIHW grad_weight in ``result_order`` (None: OIHW itself;
    ``geo.oihw_to_hwio``: the QNN filter layout)."""
    native = integration.get("Qnn_TensorType_t").QNN_TENSOR_TYPE_NATIVE
    dtype = conv.dtype
    x_node = visitor.get_node(node.args[geo.INPUT])
    x_value = visitor.get_tensor(x_node, node)  # NHWC
    x = visitor.define_tensor(x_node, node, x_value, native, nodes_to_wrappers)
    if result_order is None:
        result_order = tuple(range(conv.rank))
    if conv.is_pointwise:
        return _pointwise_weight_gradient(
            visitor,
            node,
            conv,
            x,
            list(x_value.shape),
            grad_output,
            grad_output_shape,
            result,
            nodes_to_wrappers,
            result_order,
        )
    n, *spatial, cin = (int(v) for v in x_value.shape)
    dims = list(range(1, 1 + len(spatial)))  # spatial axes of an NHWC tensor
    last = len(spatial) + 1  # channel axis of an NHWC tensor
    groups = conv.groups
    cg = cin // groups
    base = f"{node.name}_gw"
    ops = []

    # I = [Cg, *spatial, groups * N]: batch and channels exchanged, groups kept apart.
    if groups == 1:
        op, image, _ = _transpose(
            f"{base}_image",
            x,
            [n, *spatial, cin],
            (last, *dims, 0),
            dtype,
            visitor,
            nodes_to_wrappers,
        )
        ops.append(op)
    elif cg == 1:
        # Depthwise: [N, S, C] -> [S, C, N] is I up to a Reshape, and with batch 1
        # it is I already. Not the general form below: for batch 1, a 1x1
        # grad_output and a unit padded input dim it failed to compile as a 5-D
        # Transpose ("could not create op: q::ForceFormat_Crouton") and, as the 4-D
        # Transpose of [N, S, groups, 1], computes grad_weight wrongly (measured:
        # 2.2x the magnitude, V69, QAIRT 2.51). Grouped convs with Cg > 1 of the
        # same shapes are right.
        merged = math.prod(spatial)
        source = x
        if n > 1:
            op, flat = _reshape(
                f"{base}_flat", x, [n, merged, cin], dtype, visitor, nodes_to_wrappers
            )
            ops.append(op)
            op, source, _ = _transpose(
                f"{base}_swap", flat, [n, merged, cin], (1, 2, 0), dtype, visitor, nodes_to_wrappers
            )
            ops.append(op)
        op, image = _reshape(
            f"{base}_image", source, [1, *spatial, cin * n], dtype, visitor, nodes_to_wrappers
        )
        ops.append(op)
    else:
        # The spatial dims travel merged (QNN ops take at most rank 5):
        # [N, S, groups, Cg] -> [Cg, S, groups, N] -> [Cg, *spatial, groups * N].
        merged = math.prod(spatial)
        split_shape = [n, merged, groups, cg]
        op, split = _reshape(f"{base}_split", x, split_shape, dtype, visitor, nodes_to_wrappers)
        ops.append(op)
        op, swapped, _ = _transpose(
            f"{base}_swap", split, split_shape, (3, 1, 2, 0), dtype, visitor, nodes_to_wrappers
        )
        ops.append(op)
        op, image = _reshape(
            f"{base}_image", swapped, [cg, *spatial, groups * n], dtype, visitor, nodes_to_wrappers
        )
        ops.append(op)

    # F = [*out, N, C_out]: grad_output as an HWIO filter.
    op, filt, _ = _transpose(
        f"{base}_filter",
        grad_output,
        list(grad_output_shape),
        (*dims, 0, last),
        dtype,
        visitor,
        nodes_to_wrappers,
    )
    ops.append(op)

    plan = geo.plan_weight_gradient(conv)
    if plan.stuffs_filter:
        more, filt = _stuff_zeros(
            f"{base}_filter",
            filt,
            [*grad_output_shape[1:-1], n, conv.out_channels],
            plan.filter_zero_stuffing,
            dtype,
            visitor,
            nodes_to_wrappers,
        )
        ops += more
    full_shape = [cg, *plan.output_size, conv.out_channels]
    needs_slice = tuple(plan.output_size) != plan.taps
    conv_out = (
        qnn_ops.native_tensor(visitor, f"{base}_full", full_shape, dtype, nodes_to_wrappers)
        if needs_slice
        else None
    )
    hwio_shape = [cg, *plan.taps, conv.out_channels]
    hwio = qnn_ops.native_tensor(visitor, f"{base}_hwio", hwio_shape, dtype, nodes_to_wrappers)
    names = integration.get(_CONV_OPS[conv.spatial_dims])
    conv_op = qnn_ops.new_op(f"{base}_conv", names.op_name, [image, filt], [conv_out or hwio])
    qnn_ops.uint32_param(conv_op, names.param_stride, plan.stride)
    qnn_ops.uint32_param(conv_op, names.param_pad_amount, plan.pad_amount)
    qnn_ops.uint32_param(conv_op, names.param_dilation, plan.dilation)
    qnn_ops.uint32_scalar(conv_op, names.param_group, groups)
    ops.append(conv_op)
    if needs_slice:
        ranges = [[0, cg, 1], *([0, k, 1] for k in plan.taps), [0, conv.out_channels, 1]]
        ops.append(qnn_ops.strided_slice(f"{base}_crop", conv_out, hwio, ranges))
    if tuple(plan.taps) != conv.kernel:  # the taps that read only padding are zeros
        computed = hwio
        hwio_shape = [cg, *conv.kernel, conv.out_channels]
        hwio = qnn_ops.native_tensor(
            visitor, f"{base}_hwio_full", hwio_shape, dtype, nodes_to_wrappers
        )
        amounts = [[0, 0], *plan.zero_taps, [0, 0]]
        ops.append(qnn_ops.zero_pad(f"{base}_zero_taps", computed, hwio, amounts))

    # [Cg, *k, C_out] holds the OIHW dims (1, *k, 0); the result holds them in result_order.
    computed_order = (1, *(1 + d for d in dims), 0)
    perm = [computed_order.index(d) for d in result_order]
    if perm == sorted(perm):
        ops.append(qnn_ops.reshape(f"{base}_result", hwio, result))
    else:
        ops.append(qnn_ops.transpose(f"{base}_result", hwio, result, perm))
    return ops


def bias_gradient(node: torch.fx.Node, grad_output, rank: int, result) -> list:
    """ReduceSum of grad_output (NHWC) over every axis but the channels."""
    names = integration.get("OpReduceSum")
    op = qnn_ops.new_op(f"{node.name}_gb", names.op_name, [grad_output], [result])
    qnn_ops.uint32_param(op, names.param_axes, list(range(rank - 1)))
    qnn_ops.bool_scalar(op, names.param_keep_dims, False)
    return [op]
