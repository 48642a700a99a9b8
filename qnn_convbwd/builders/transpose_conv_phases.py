"""grad_input of a strided 2-D convolution as one stride-1 TransposeConv2d per phase.

``Options.stride="phases"``; the geometry is ``phase_geometry``. The ops:

    HWOI filter (the one Transpose of the shared HWIO weight, ``weights``)
      -> StridedSlice per phase: taps ``c::s`` of each kernel dim (no new static)
    grad_output -> TransposeConv2d (stride 1, the phase's pad_amount) per phase
      [-> Pad: zero rows past the op's full extent]
    interleave, per strided dim d (last first): each phase viewed as
      ``[lead, Q_d, 1, trail]``, Concat on axis 2 over the phases of that dim,
      Pad axis 2 to ``s_d`` (the zero phases), Reshape to ``Q_d s_d`` rows
    -> StridedSlice crop -> grad_input

Every view is rank 4 (the HTP's Reshape rejects rank 6). The kernel slices are
cached per weight and stride, so two backward nodes of one weight share them.
"""

from __future__ import annotations

import math

from .. import integration
from ..geometry import conv as geo
from ..geometry import phases as phg
from . import qnn_ops, weights

# How the phases are put back together where every phase is computed (taps == stride):
# "concat_reshape" (per dim: Reshape / Concat / Reshape) or "depth_to_space" (one
# Concat on the channels and DepthToSpace). Phases with zero phases (kernel < stride)
# always take the per-dim path.
INTERLEAVE = "concat_reshape"


def _kernel_slice(req, hwoi, weight_node, plan: phg.PhasePlan, phase: phg.Phase):
    """(ops, filter): taps ``offset::stride`` of the HWOI filter ``[kH, kW, O, I/g]``."""
    if phase.kernel == plan.kernel:  # every strided dim has a kernel of 1
        return [], hwoi
    tag = "x".join(map(str, plan.stride)) + "_c" + "x".join(map(str, phase.offset))
    name = f"{weights.hwoi_name(weight_node)}_phase_s{tag}"
    cached = req.nodes_to_wrappers.get(name, {}).get(0)
    if cached is not None:
        return [], cached
    value = weight_node.meta["val"]
    out_c, in_g = int(value.shape[0]), int(value.shape[1])
    sliced = qnn_ops.native_tensor(
        req.visitor,
        name,
        [*phase.kernel, out_c, in_g],
        weights.filter_dtype(weight_node),
        req.nodes_to_wrappers,
    )
    ranges = [
        *([c, k, s] for c, k, s in zip(phase.offset, plan.kernel, plan.stride)),
        [0, out_c, 1],
        [0, in_g, 1],
    ]
    return [qnn_ops.strided_slice(f"{name}_op", hwoi, sliced, ranges)], sliced


def build(req, conv, weight: weights.WeightTensors) -> list:
    """The ops from ``req.grad_output`` to ``req.grad_input`` (NHWC) for ``conv``
    (2-D, in its own spatial order), reading the filter ``weight.hwoi``."""
    visitor, node, n2w = req.visitor, req.node, req.nodes_to_wrappers
    plan = phg.plan_phases(conv)
    dtype = req.grad_input_value.dtype
    weight_node = visitor.get_node(node.args[geo.WEIGHT])
    n, *_, channels = (int(v) for v in req.grad_input_value.shape)
    names = integration.get("OpTransposeConv2d")
    spatial = len(plan.stride)

    def tensor(tag: str, shape):
        return qnn_ops.native_tensor(visitor, f"{node.name}_{tag}", shape, dtype, n2w)

    ops = list(weight.ops)
    results = {}
    for phase in plan.phases:
        tag = "phase" + "x".join(map(str, phase.offset))
        slice_ops, kernel = _kernel_slice(req, weight.hwoi, weight_node, plan, phase)
        ops += slice_ops
        sizes = [q - extra for q, extra in zip(plan.rows, phase.result_pad_end)]
        result = tensor(tag, [n, *sizes, channels])
        tconv = qnn_ops.new_op(
            f"{node.name}_{tag}", names.op_name, [req.grad_output, kernel], [result]
        )
        qnn_ops.uint32_param(tconv, names.param_stride, [1] * spatial)
        qnn_ops.uint32_param(tconv, names.param_pad_amount, phase.pad_amount)
        qnn_ops.uint32_param(tconv, names.param_output_padding, [0] * spatial)
        qnn_ops.uint32_scalar(tconv, names.param_group, plan.groups)
        ops.append(tconv)
        if any(phase.result_pad_end):
            padded = tensor(f"{tag}_rows", [n, *plan.rows, channels])
            ops.append(
                qnn_ops.zero_pad_end(
                    f"{node.name}_{tag}_rows", result, padded, phase.result_pad_end
                )
            )
            result = padded
        results[phase.offset] = result

    concat = integration.get("OpConcat")
    sizes = list(plan.rows)
    by_channels = INTERLEAVE == "depth_to_space" and plan.taps == plan.stride
    if by_channels:
        # Every phase computed: Concat on the channels in row-major phase order, then
        # DepthToSpace (DCR: channel (r_h s_w + r_w) C + c goes to row q_h s_h + r_h,
        # column q_w s_w + r_w).
        stacked = tensor("phases_cat", [n, *sizes, len(plan.phases) * channels])
        inputs = [results[phase.offset] for phase in plan.phases]
        op = qnn_ops.new_op(f"{node.name}_phases_cat", concat.op_name, inputs, [stacked])
        qnn_ops.uint32_scalar(op, concat.param_axis, 1 + spatial)
        ops.append(op)
        sizes = list(plan.interleaved)
        interleaved = tensor("interleaved", [n, *sizes, channels])
        names = integration.get("OpDepthToSpace")
        op = qnn_ops.new_op(f"{node.name}_interleave", names.op_name, [stacked], [interleaved])
        qnn_ops.uint32_param(op, names.param_block_size, list(plan.stride))
        qnn_ops.uint32_scalar(op, names.param_mode, names.Mode.DCR)
        ops.append(op)
        results = {(0,) * spatial: interleaved}
    for d in reversed(range(spatial)):
        s = plan.stride[d]
        if s == 1 or by_channels:
            continue
        if plan.taps[d] == 1:  # one phase and zeros: upsample it (no Concat)
            tag = f"interleave{d}"
            merged = {}
            for key, part in sorted(results.items()):
                factors = [s if i == d else 1 for i in range(spatial)]
                up_ops, up, _ = qnn_ops.zero_insert(
                    visitor,
                    f"{node.name}_{tag}_" + "x".join(map(str, key)),
                    part,
                    [n, *sizes, channels],
                    factors,
                    dtype,
                    n2w,
                )
                ops += up_ops
                merged[key] = up
            sizes[d] *= s
            results = merged
            continue
        lead = n * math.prod(sizes[:d])
        trail = math.prod(sizes[d + 1 :]) * channels
        longer = list(sizes)
        longer[d] *= s
        merged = {}
        for key in sorted({k[:d] + k[d + 1 :] for k in results}):
            tag = f"interleave{d}_" + "x".join(map(str, key))
            views = []
            for c in range(plan.taps[d]):
                view = tensor(f"{tag}_v{c}", [lead, sizes[d], 1, trail])
                part = results[key[:d] + (c,) + key[d:]]
                ops.append(qnn_ops.reshape(f"{node.name}_{tag}_v{c}", part, view))
                views.append(view)
            stacked = views[0]
            if len(views) > 1:
                stacked = tensor(f"{tag}_cat", [lead, sizes[d], len(views), trail])
                op = qnn_ops.new_op(f"{node.name}_{tag}_cat", concat.op_name, views, [stacked])
                qnn_ops.uint32_scalar(op, concat.param_axis, 2)
                ops.append(op)
            if len(views) < s:  # the zero phases (kernel < stride)
                filled = tensor(f"{tag}_zeros", [lead, sizes[d], s, trail])
                amounts = [[0, 0], [0, 0], [0, s - len(views)], [0, 0]]
                ops.append(qnn_ops.zero_pad(f"{node.name}_{tag}_zeros", stacked, filled, amounts))
                stacked = filled
            out = tensor(tag, [n, *longer, channels])
            ops.append(qnn_ops.reshape(f"{node.name}_{tag}", stacked, out))
            merged[key[:d] + (0,) + key[d:]] = out
        sizes = longer
        results = merged

    (interleaved,) = results.values()
    ranges = [[0, n, 1], *([b, size - e, 1] for (b, e), size in zip(plan.crop, sizes))]
    ranges.append([0, channels, 1])
    ops.append(qnn_ops.strided_slice(f"{node.name}_crop", interleaved, req.grad_input, ranges))
    return ops
