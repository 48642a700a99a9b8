"""Generated convolution_backward configurations: each one is delegated and
computes torch's numbers, or stays on CPU with one logged reason, and none
breaks the lowering.

Three tiers, cheapest first. Each runs at a default size and as a long run
marked ``slow`` (skipped unless ``--slow``); example counts default / long:

1. ``test_decisions`` (60 / 3000): ``decide`` on the exported node agrees with
   an independent reading of the configuration, logs one line per rejection,
   and for delegated nodes the transposed-convolution plan reproduces
   ``aten.convolution_backward``'s grad_input (through a model of QNN
   TransposeConv2d, and through torch's ``conv_transpose``).
2. ``test_visitor_and_validation`` (15 / 100): executorch's QNN passes, then
   executorch's support check (patched by the plugin): the QNN ops the visitor
   emits, parameters read back at the QNN op wrapper, reproduce grad_input, and
   the HTP backend's op validation accepts them.
3. ``test_compiled`` (15 / 100): full lowering for the SoC and a run of the
   ``.pte`` (HTP simulator for delegated nodes, CPU kernels otherwise).

Per-rule counts and worst errors are printed at the end of the module and kept
in pytest's cache under ``qnn_convbwd/property_stats``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import math
import re
import time

import cases
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qnn_convbwd.builders import qnn_ops
from qnn_convbwd.geometry import conv as geo
from qnn_convbwd.partition import support
from qnn_convbwd.partition.target import MIN_HTP_ARCH, Target

SOC_ARCH = {"SM8350": 68, "SM8450": 69, "SM8550": 73, "SM8650": 75, "SM8750": 79, "SM8850": 81}
NOT_DELEGATED = re.compile(r"^convolution_backward (\S+): not delegated: (.*)$")
MASKS = [
    (True, False, False),
    (True, True, False),
    (True, False, True),
    (False, True, False),
    (True, True, True),
]

STATS: dict = collections.defaultdict(collections.Counter)
WORST: dict[str, float] = collections.defaultdict(float)


# Every property test runs at its default size and, marked slow, as a long run.
RUN_SIZES = pytest.mark.parametrize(
    "size", ["default", pytest.param("long", marks=pytest.mark.slow(reason="long property run"))]
)


def _examples(size: str, default: int, long: int) -> int:
    return long if size == "long" else default


def _settings(n: int):
    return settings(
        max_examples=n,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        print_blob=True,
    )


# --- configurations ------------------------------------------------------------------------


@st.composite
def conv_configs(draw, rank=None, mask=None, soc=None):
    """(ConvConfig, SoC). Sizes stay small; rank 5 smaller still."""
    spatial = draw(rank or st.sampled_from([4, 4, 4, 3, 5])) - 2
    kind = draw(st.sampled_from(["single", "grouped", "depthwise"]))
    if kind == "single":
        groups = 1
        cin, cout = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    elif kind == "grouped":
        groups = draw(st.integers(2, 4))
        cin, cout = groups * draw(st.integers(1, 3)), groups * draw(st.integers(1, 3))
    else:  # depthwise, channel multiplier 1 or 2
        groups = draw(st.integers(2, 8))
        cin, cout = groups, groups * draw(st.integers(1, 2))
    per_dim = st.lists(st.integers(1, 5), min_size=spatial, max_size=spatial)
    kernel = tuple(draw(per_dim))
    stride = tuple(draw(st.lists(st.integers(1, 3), min_size=spatial, max_size=spatial)))
    padding = tuple(draw(st.lists(st.integers(0, 2), min_size=spatial, max_size=spatial)))
    dilation = tuple(draw(st.lists(st.sampled_from([1, 1, 2]), min_size=spatial, max_size=spatial)))
    extra = 4 if spatial == 3 else 9
    size = []
    for k, p, d in zip(kernel, padding, dilation):
        smallest = max(1, d * (k - 1) + 1 - 2 * p)  # the forward conv has one output
        size.append(draw(st.integers(smallest, smallest + extra)))
    config = cases.ConvConfig(
        in_channels=cin,
        out_channels=cout,
        kernel=kernel,
        input_size=tuple(size),
        stride=stride,
        padding=padding,
        dilation=dilation,
        groups=groups,
        batch=draw(st.integers(1, 2)),
        output_mask=draw(mask or st.sampled_from(MASKS[:1] * 4 + MASKS[1:])),
    )
    return config, draw(soc or st.sampled_from(list(SOC_ARCH)))


# Tiers 2 and 3 lean towards configurations that are delegated, where there is
# more to check; the others still come up.
delegable = conv_configs(
    rank=st.sampled_from([4] * 8 + [3, 5]),
    mask=st.sampled_from(MASKS[:1] * 8 + MASKS[1:]),
    soc=st.sampled_from([s for s, a in SOC_ARCH.items() if a >= 69] * 4 + ["SM8350"]),
)


def expected_rule(config: cases.ConvConfig, soc: str) -> str | None:
    """Which rule should reject the node, read from the configuration alone."""
    if SOC_ARCH[soc] < MIN_HTP_ARCH:
        return "htp_arch_supported"
    asked = {g for g, m in zip(("grad_input", "grad_weight", "grad_bias"), config.output_mask) if m}
    if not asked <= support.CAPABILITIES:
        return "requested_gradients"
    if f"conv{config.spatial_dims}d" not in support.CAPABILITIES:
        return "spatial_dims"
    if any(d > 1 for d in config.dilation) and "dilation" not in support.CAPABILITIES:
        return "dilation"
    if config.output_mask[0] and config.spatial_dims == 3 and len(set(config.stride)) == 3:
        return "transpose_conv3d_strides"  # TransposeConv3d defect (see the rule)
    return None


# --- references ------------------------------------------------------------------------------


def reference64(built: cases.Built) -> tuple[torch.Tensor, ...]:
    """aten.convolution_backward in float64: what every tier is compared with."""
    grad_output, x = (t.double() for t in built.inputs[:2])
    weight = built.module.weight.double()
    return torch.ops.aten.convolution_backward.default(grad_output, x, weight, *built.config.args())


def qnn_transpose_conv(
    grad_output: torch.Tensor,
    weight_iohw: torch.Tensor,
    stride,
    pad_amount,
    output_padding,
    groups: int,
) -> torch.Tensor:
    """A model of QNN TransposeConv{1,2,3}d on NC<spatial> tensors.

    Per spatial dim the output is the full transposed convolution,
    ``(in - 1) * stride + k`` elements, grown by ``output_padding`` zeros at the
    end, then cropped by ``pad_amount = (begin, end)``. The weight is in torch's
    conv_transpose layout ``[C_in_t, C_out_t / groups, *k]``.
    """
    n = grad_output.dim() - 2
    conv_transpose = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[n - 1]
    full = conv_transpose(grad_output, weight_iohw, stride=tuple(stride), groups=groups)
    grown = _pad_end(full, output_padding)
    crop = tuple(
        slice(begin, grown.shape[2 + i] - end) for i, (begin, end) in enumerate(pad_amount)
    )
    return grown[(slice(None), slice(None), *crop)]


def ratio_to_magnitude(actual, expected, magnitude) -> float:
    return cases.worst_ratio(actual, expected, magnitude, atol=1e-12)


def magnitude64(built: cases.Built) -> tuple[torch.Tensor, ...]:
    grad_output, x = (t.double() for t in built.inputs[:2])
    return torch.ops.aten.convolution_backward.default(
        grad_output.abs(), x.abs(), built.module.weight.double().abs(), *built.config.args()
    )


def _pad_end(x: torch.Tensor, amounts) -> torch.Tensor:
    """Append ``amounts[i]`` zeros after spatial dim i of an NC<spatial> tensor."""
    n = x.dim() - 2
    return F.pad(x, [a for i in reversed(range(n)) for a in (0, amounts[i])])


def _zero_insert(x: torch.Tensor, factors) -> torch.Tensor:
    """Spatial dim i of an NC<spatial> tensor upsampled by ``factors[i]``: element j
    at ``j * f``, zeros elsewhere (also after the last element)."""
    out = x.new_zeros(*x.shape[:2], *(size * f for size, f in zip(x.shape[2:], factors)))
    out[(slice(None), slice(None), *(slice(None, None, f) for f in factors))] = x
    return out


def dilated(weight: torch.Tensor, dilation) -> torch.Tensor:
    """The filter with ``d - 1`` zeros between taps: TransposeConv2d has no dilation."""
    kernel = [d * (k - 1) + 1 for d, k in zip(dilation, weight.shape[2:])]
    out = weight.new_zeros(*weight.shape[:2], *kernel)
    out[(slice(None), slice(None), *(slice(None, None, d) for d in dilation))] = weight
    return out


def dense(weight: torch.Tensor, groups: int) -> torch.Tensor:
    """A grouped ``[C_out, C_in/g, *k]`` weight as the block-diagonal ``[C_out, C_in, *k]``
    an ungrouped op computes the same with (TransposeConv3d ignores groups)."""
    if groups == 1:
        return weight
    out_c, in_g = weight.shape[:2]
    per = out_c // groups
    result = weight.new_zeros(out_c, in_g * groups, *weight.shape[2:])
    for g in range(groups):
        result[g * per : (g + 1) * per, g * in_g : (g + 1) * in_g] = weight[g * per : (g + 1) * per]
    return result


def _slice_result(x: torch.Tensor, plan: geo.TransposedConvPlan) -> torch.Tensor:
    """The "crop" plan's StridedSlice of the op's full extent."""
    if not plan.result_slice:
        return x
    assert tuple(x.shape[2:]) == plan.full_size
    return x[(slice(None), slice(None), *(slice(b, e) for b, e in plan.result_slice))]


def check_plans(conv: geo.ConvBackward, built: cases.Built) -> None:
    """Every stride and output_padding mode's plan gives aten's grad_input (in the model)."""
    grad_output = built.inputs[0].double()
    # OIHW = conv_transpose's [C_in_t, C_out_t/g, k]
    weight = dilated(built.module.weight.double(), conv.dilation)
    (want, *_), (scale, *_) = reference64(built), magnitude64(built)
    modes = [(m, "parameter") for m in geo.OUTPUT_PADDING_MODES] + [("auto", "zero_insert")]
    for mode, stride in modes:
        plan = geo.plan_input_gradient(conv, mode, stride)
        assert plan.groups * plan.dense_groups == conv.groups
        upsampling = stride == "zero_insert" and conv.spatial_dims < 3 and max(conv.stride) > 1
        assert plan.upsamples == upsampling
        before = plan.upsamples and not plan.upsample_output
        source = _zero_insert(grad_output, plan.zero_insert) if before else grad_output
        op_weight = dense(weight, plan.dense_groups)
        got = qnn_transpose_conv(
            _pad_end(source, plan.grad_output_pad_end),
            op_weight,
            plan.stride,
            plan.pad_amount,
            plan.output_padding,
            plan.groups,
        )
        got = _slice_result(got, plan)
        if plan.upsample_output:
            got = _zero_insert(got, plan.zero_insert)
            got = got[
                (
                    slice(None),
                    slice(None),
                    *(slice(b, got.shape[2 + i] - e) for i, (b, e) in enumerate(plan.output_crop)),
                )
            ]
        ratio = ratio_to_magnitude(got, want, scale)
        assert ratio < 1e-12, f"plan({mode}, {stride}) {plan} is off by {ratio:.3g} x magnitude"
        if plan.upsamples:
            assert set(plan.stride) == {1} and not any(plan.output_padding)
        if mode == "parameter" and stride == "parameter":
            # torch's own transposed convolution with the plan's parameters.
            assert all(b == e for b, e in plan.pad_amount) and not any(plan.grad_output_pad_end)
            transpose = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)
            torch_got = transpose[conv.spatial_dims - 1](
                grad_output,
                op_weight,
                stride=plan.stride,
                padding=tuple(b for b, _ in plan.pad_amount),
                output_padding=plan.output_padding,
                groups=plan.groups,
            )
            assert ratio_to_magnitude(torch_got, want, scale) < 1e-12


# --- observing the emitted QNN ops -----------------------------------------------------------


@dataclasses.dataclass
class EmittedOp:
    name: str
    type: str
    params: dict
    inputs: list[str] = dataclasses.field(default_factory=list)
    outputs: list[str] = dataclasses.field(default_factory=list)
    output_dims: list[list[int] | None] = dataclasses.field(default_factory=list)


def _tensor_name(tensor) -> str:
    get_name = getattr(tensor, "GetName", None)
    return get_name() if get_name is not None else f"<unnamed {id(tensor)}>"


@contextlib.contextmanager
def recording_qnn_ops(monkeypatch_context):
    """Every QNN op built while active: type, parameters and tensor names as handed
    to executorch's op wrapper (the last step before the QNN API)."""
    from executorch.backends.qualcomm.python import PyQnnManagerAdaptor as adaptor

    emitted: list[EmittedOp] = []
    base = adaptor.PyQnnOpWrapper
    # Tensor wrappers have no name accessor and are told apart by id(); holding
    # every one seen keeps ids from being reused by later wrappers.
    seen: list = []
    dims: dict[str, list[int]] = {}  # the plugin's native tensors: name -> dims
    native_tensor = qnn_ops.native_tensor

    def recording_native_tensor(visitor, name, shape, dtype, nodes_to_wrappers):
        wrapper = native_tensor(visitor, name, shape, dtype, nodes_to_wrappers)
        seen.append(wrapper)
        dims[_tensor_name(wrapper)] = [int(v) for v in shape]
        return wrapper

    class Recording(base):
        def __init__(self, name, package, op_type):
            super().__init__(name, package, op_type)
            self.emitted = EmittedOp(name, op_type, {})
            emitted.append(self.emitted)

        def AddInputTensors(self, tensors):  # noqa: N802
            seen.extend(tensors)
            self.emitted.inputs += [_tensor_name(t) for t in tensors]
            return super().AddInputTensors(tensors)

        def AddOutputTensors(self, tensors):  # noqa: N802
            seen.extend(tensors)
            self.emitted.outputs += [_tensor_name(t) for t in tensors]
            self.emitted.output_dims += [dims.get(_tensor_name(t)) for t in tensors]
            return super().AddOutputTensors(tensors)

        def AddTensorParam(self, name, dtype, rank, dims, data, copy):  # noqa: N802
            self.emitted.params[name] = np.asarray(data).tolist()
            return super().AddTensorParam(name, dtype, rank, dims, data, copy)

        def AddScalarParam(self, name, dtype, attr):  # noqa: N802
            (value,) = attr.values()
            self.emitted.params[name] = value.item() if hasattr(value, "item") else value
            return super().AddScalarParam(name, dtype, attr)

    monkeypatch_context.setattr(adaptor, "PyQnnOpWrapper", Recording)
    monkeypatch_context.setattr(qnn_ops, "native_tensor", recording_native_tensor)

    # Tensors of graph values (e.g. grad_input, which an op may write directly).
    from executorch.backends.qualcomm.builders.node_visitor import NodeVisitor

    define_tensor = NodeVisitor.define_tensor

    def recording_define_tensor(self, source_node, build_node, tensor, *args, **kwargs):
        wrapper = define_tensor(self, source_node, build_node, tensor, *args, **kwargs)
        seen.append(wrapper)
        dims.setdefault(_tensor_name(wrapper), [int(v) for v in tensor.shape])
        return wrapper

    monkeypatch_context.setattr(NodeVisitor, "define_tensor", recording_define_tensor)
    yield emitted


def _nchw_dim(nhwc_dim: int, rank: int) -> int:
    """QNN tensors are N<spatial>C; torch's are NC<spatial>."""
    return {0: 0, rank - 1: 1}.get(nhwc_dim, nhwc_dim + 1)


TRANSPOSE_CONVS = ("TransposeConv2d", "TransposeConv3d")


def _model_op(
    op: EmittedOp,
    x: torch.Tensor,
    order: tuple[int, ...],
    weight_iohw: torch.Tensor,
    groups: int,
) -> tuple[torch.Tensor, tuple[int, ...]] | None:
    """What ``op`` computes from ``x`` (its first input), for the ops on the
    grad_output -> grad_input path; None for ops this model does not cover.
    ``order``: which of the convolution's spatial dims each spatial dim of ``x``
    is (a Transpose may reorder them); returned with the result.
    ``weight_iohw`` is grouped by the convolution's ``groups``. The HTP's
    TransposeConv3d ignores its group parameter: the plugin must run it
    ungrouped, with the filter block-diagonal (``geo.transpose_conv_applies_groups``)."""
    rank = x.dim()
    if op.type in TRANSPOSE_CONVS:
        if op.type == "TransposeConv3d":
            assert op.params["group"] == 1, f"{op.name}: group {op.params['group']} is ignored"
            weight_iohw = dense(weight_iohw, groups)
        weight_iohw = weight_iohw.permute(0, 1, *(2 + o for o in order))
        result = qnn_transpose_conv(
            x,
            weight_iohw,
            op.params["stride"],
            op.params["pad_amount"],
            op.params["output_padding"],
            op.params["group"],
        )
        return result, order
    if op.type == "Pad":
        amounts = op.params["pad_amount"]
        assert op.params.get("scheme", 0) == 0 and op.params.get("pad_constant_value", 0) == 0
        pads = [0] * (2 * rank)
        for d, (begin, end) in enumerate(amounts):
            i = _nchw_dim(d, rank)
            pads[2 * (rank - 1 - i)], pads[2 * (rank - 1 - i) + 1] = begin, end
        return F.pad(x, pads), order
    if op.type == "Reshape":
        (shape,) = op.output_dims
        assert shape is not None, f"{op.name}: output dims not recorded"
        return x.movedim(1, -1).reshape(shape).movedim(-1, 1), order
    if op.type == "StridedSlice":
        index = [slice(None)] * rank
        for d, (begin, end, step) in enumerate(op.params["ranges"]):
            index[_nchw_dim(d, rank)] = slice(begin, end, step)
        return x[tuple(index)], order
    if op.type == "Transpose":
        perm = list(op.params["perm"])  # NHWC: result dim i is source dim perm[i]
        assert perm[0] == 0 and perm[-1] == rank - 1, f"{op.name} moves N or C: {perm}"
        spatial = [p - 1 for p in perm[1:-1]]
        return x.permute(0, 1, *(2 + p for p in spatial)), tuple(order[p] for p in spatial)
    return None


def emitted_grad_input(emitted: list[EmittedOp], built: cases.Built) -> torch.Tensor:
    """Follow grad_output through the emitted Transpose / Pad / TransposeConv /
    StridedSlice / Transpose ops of the node.

    The parameters are the ones handed to QNN; the filter is taken as torch's
    weight, its kernel dims in the order the activations' Transposes give (the
    weight's own path is checked by the simulator runs).
    """
    tconvs = [op for op in emitted if op.type in TRANSPOSE_CONVS]
    assert tconvs, f"no TransposeConv among {[op.type for op in emitted]}"
    tconv = tconvs[-1]
    if PHASE_TAG in tconv.name:  # Options.stride="phases"
        return emitted_phase_grad_input(emitted, built, tconv.name.rsplit(PHASE_TAG, 1)[0])

    # The node's own ops around its TransposeConv (builders/input_gradient.py names them).
    around = {f"{tconv.name}_{step}" for step in ("reorder", "pad", "crop", "restore")}

    def on_path(op: EmittedOp) -> bool:
        return op.name in around or op.name.startswith(f"{tconv.name}_upsampled")

    producer = {out: op for op in emitted for out in op.outputs}
    root = tconv.inputs[0]
    while root in producer and on_path(producer[root]):
        root = producer[root].inputs[0]
    # conv weight OIHW = [C_in_t, C_out_t/g, k]
    weight_iohw = dilated(built.module.weight.double(), built.config.dilation)
    grad_output = built.inputs[0].double()
    one_d = built.config.spatial_dims == 1
    if one_d:  # lowered as 2-D with a unit height (passes/conv1d.py)
        weight_iohw, grad_output = weight_iohw.unsqueeze(2), grad_output.unsqueeze(2)
    values = {root: (grad_output, tuple(range(grad_output.dim() - 2)))}
    for op in emitted:
        if op.inputs and op.inputs[0] in values and (op is tconv or on_path(op)):
            result = _model_op(op, *values[op.inputs[0]], weight_iohw, built.config.groups)
            if result is not None:
                values[op.outputs[0]] = result
    end = tconv.outputs[0]
    consumer = {op.inputs[0]: op for op in emitted if on_path(op)}
    while end in consumer:
        end = consumer[end].outputs[0]
    value, order = values[end]
    assert order == tuple(sorted(order)), f"grad_input left with spatial dims in order {order}"
    return value.squeeze(2) if one_d else value


# builders/transpose_conv_phases.py names its ops ``<node>_phase<offsets>``, ...
PHASE_TAG = "_phase"


def _nhwc_op(op: EmittedOp, inputs: list[torch.Tensor], filters: dict) -> torch.Tensor | None:
    """What ``op`` computes on NHWC tensors, for the ops of the phase decomposition."""
    x = inputs[0]
    if op.type == "TransposeConv2d":
        assert op.params["stride"] == [1, 1] and op.params["output_padding"] == [0, 0]
        nchw = qnn_transpose_conv(
            x.permute(0, 3, 1, 2),
            filters[op.inputs[1]],
            op.params["stride"],
            op.params["pad_amount"],
            op.params["output_padding"],
            op.params["group"],
        )
        return nchw.permute(0, 2, 3, 1)
    if op.type == "Pad":
        assert op.params.get("pad_constant_value", 0) == 0
        amounts = op.params["pad_amount"]
        return F.pad(x, [a for begin_end in reversed(amounts) for a in begin_end])
    if op.type == "Reshape":
        (shape,) = op.output_dims
        return x.reshape(shape)
    if op.type == "Concat":
        return torch.cat(inputs, dim=op.params["axis"])
    if op.type == "StridedSlice":
        return x[tuple(slice(b, e, st) for b, e, st in op.params["ranges"])]
    if op.type == "DepthToSpace":
        assert op.params["mode"] == 0  # DCR
        bh, bw = op.params["block_size"]
        n, h, w, c = x.shape
        x = x.reshape(n, h, w, bh, bw, c // (bh * bw)).permute(0, 1, 3, 2, 4, 5)
        return x.reshape(n, h * bh, w * bw, c // (bh * bw))
    return None


def emitted_phase_grad_input(emitted: list[EmittedOp], built: cases.Built, node: str):
    """Follow grad_output through the phase TransposeConvs (their filters the emitted
    StridedSlices of the weight's HWOI filter) and the interleave to the node's crop."""
    weight_iohw = built.module.weight.double()  # conv weight OIHW = [C_in_t, C_out_t/g, k]
    grad_output = built.inputs[0].double()
    if built.config.spatial_dims == 1:  # lowered as 2-D with a unit height
        weight_iohw, grad_output = weight_iohw.unsqueeze(2), grad_output.unsqueeze(2)
    steps = (f"{node}{PHASE_TAG}", f"{node}_interleave", f"{node}_crop")
    # A compiled program builds each op twice (partitioner validation, then the
    # delegate): keep the last of each name.
    own = list({op.name: op for op in emitted if op.name.startswith(steps)}.values())
    tconvs = [op for op in own if op.type == "TransposeConv2d"]
    producer = {out: op for op in emitted for out in op.outputs}
    filters = {}
    for tconv in tconvs:
        name = tconv.inputs[1]
        source = producer.get(name)
        if source is not None and source.type == "StridedSlice":  # taps c::s of [kH, kW, O, I]
            (h, w) = (slice(b, e, st) for b, e, st in source.params["ranges"][:2])
            filters[name] = weight_iohw[:, :, h, w]
        else:  # the whole filter (kernel 1 in every strided dim)
            filters[name] = weight_iohw
    roots = {t.inputs[0] for t in tconvs}
    assert len(roots) == 1, f"phases read different grad_outputs: {roots}"
    values = {roots.pop(): grad_output.permute(0, 2, 3, 1)}
    for op in own:
        if op.inputs and all(i in values for i in op.inputs if i not in filters):
            result = _nhwc_op(op, [values[i] for i in op.inputs if i not in filters], filters)
            if result is not None:
                values[op.outputs[0]] = result
    (crop,) = [op for op in own if op.name == f"{node}_crop"]
    value = values[crop.outputs[0]].permute(0, 3, 1, 2)
    return value.squeeze(2) if built.config.spatial_dims == 1 else value


def check_emitted(emitted: list[EmittedOp], built: cases.Built, tier: str) -> None:
    (want, *_), (scale, *_) = reference64(built), magnitude64(built)
    got = emitted_grad_input(emitted, built)
    phases = any(PHASE_TAG in op.name for op in emitted if op.type in TRANSPOSE_CONVS)
    plan = " (stride phases)" if phases else ""
    key = f"{tier}: emitted QNN params{plan}, model vs aten (x magnitude)"
    ratio = ratio_to_magnitude(got, want, scale)
    WORST[key] = max(WORST[key], ratio)
    assert ratio < 1e-12, f"emitted QNN parameters give grad_input off by {ratio:.3g}"


# --- logs --------------------------------------------------------------------------------------


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if NOT_DELEGATED.match(record.getMessage()):
            self.records.append(record)


@contextlib.contextmanager
def not_delegated_lines():
    logger = logging.getLogger("qnn_convbwd")
    handler, level = _Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def rule_of(record: logging.LogRecord) -> str:
    return getattr(record, "convbwd_rule", None) or f"other: {record.getMessage()}"


# --- tier 1: decisions and plans ----------------------------------------------------------------


_TARGETS: dict[str, Target] = {}


def target_for(soc: str) -> Target:
    """Target from executorch compile specs for ``soc`` (no SDK needed to build them)."""
    if soc not in _TARGETS:
        from executorch.backends.qualcomm.serialization.qc_schema import QcomChipset
        from executorch.backends.qualcomm.utils.utils import (
            generate_htp_compiler_spec,
            generate_qnn_executorch_compiler_spec,
        )

        specs = generate_qnn_executorch_compiler_spec(
            getattr(QcomChipset, soc), generate_htp_compiler_spec(use_fp16=True)
        )
        _TARGETS[soc] = Target.from_compile_specs(specs)
    return _TARGETS[soc]


@RUN_SIZES
def test_decisions(size):
    # 60 by default (an export each, the quick tier's longest test at 150); 3000 with --slow.
    n = _examples(size, 60, 3000)
    stats = STATS["1 decisions"]

    @_settings(n)
    @given(drawn=conv_configs(), seed=st.integers(0, 2**16))
    def run(drawn, seed):
        config, soc = drawn
        built = cases.build(config, seed)
        (node,) = cases.conv_backward_nodes(built.program.graph)
        with not_delegated_lines() as lines:
            decision = support.decide(node, target_for(soc).with_program(built.program))
        want = expected_rule(config, soc)
        got = None if decision.supported else decision.rejection.rule
        assert got == want, f"{config.describe()} on {soc}: {got} != {want}"
        assert [rule_of(r) for r in lines] == ([want] if want else [])
        stats["examples"] += 1
        stats[f"rank {len(config.kernel) + 2}"] += 1
        stats[want or "delegated"] += 1
        if decision.supported and config.output_mask[0]:
            check_plans(decision.parsed, built)

    run()
    assert stats["examples"] >= n


# --- tier 2: visitor and backend op validation, without compiling --------------------------------


def _compile_specs(soc: str) -> list:
    from qnn_convbwd.toolchain import harness

    return harness.compile_specs(soc)


@pytest.mark.htp
@RUN_SIZES
def test_visitor_and_validation(size, qnn_sdk, plugin):
    from executorch.backends.qualcomm.partition.qnn_partitioner import QnnOperatorSupport
    from executorch.backends.qualcomm.utils.qnn_manager_lifecycle import QnnManagerContext

    n = _examples(size, 15, 100)
    stats = STATS["2 visitor + validation"]

    @_settings(n)
    @given(drawn=delegable, seed=st.integers(0, 2**16))
    def run(drawn, seed):
        config, soc = drawn
        built = cases.build(config, seed)
        specs = _compile_specs(soc)
        edge = cases.qnn_edge(built.program, specs)
        # The plugin's passes may have split the node (grad_input apart from
        # grad_weight/grad_bias) or lifted a 1-D one to 2-D; judge each node.
        nodes = cases.conv_backward_nodes(edge.graph)
        with (
            pytest.MonkeyPatch.context() as mp,
            recording_qnn_ops(mp) as emitted,
            not_delegated_lines() as lines,
            QnnManagerContext({"forward": specs}),
        ):
            checker = QnnOperatorSupport(edge, specs, set(), set())
            verdicts = []
            for node in nodes:
                supported = checker.is_node_supported(None, node)
                getitems = [checker.is_node_supported(None, u) for u in node.users]
                assert all(g == supported for g in getitems), node.name
                mask = tuple(bool(m) for m in node.args[geo.OUTPUT_MASK])
                want = expected_rule(dataclasses.replace(config, output_mask=mask), soc)
                assert supported == (want is None), f"{config.describe()} on {soc}: {node}"
                verdicts.append((mask, want))
        rejected = sorted(w for _, w in verdicts if w)
        assert sorted(rule_of(r) for r in lines) == rejected, config.describe()
        stats["examples"] += 1
        stats["nodes after the passes"] += len(nodes)
        for _, want in verdicts:
            stats[want or "delegated"] += 1
        if any(mask[0] and want is None for mask, want in verdicts):
            check_emitted(emitted, built, "2")
        elif rejected == [w for _, w in verdicts]:
            assert not emitted, "ops were built for a node the rules rejected"

    run()
    assert stats["examples"] >= n


# --- tier 3: compile and run ---------------------------------------------------------------


@pytest.mark.htp
@RUN_SIZES
def test_compiled(size, qnn_sdk):
    from qnn_convbwd.toolchain import harness

    n = _examples(size, 15, 100)
    stats = STATS["3 compiled + run"]

    @_settings(n)
    @given(drawn=delegable, seed=st.integers(0, 2**16))
    def run(drawn, seed):
        config, soc = drawn
        built = cases.build(config, seed)
        want = expected_rule(config, soc)
        start = time.perf_counter()
        with (
            pytest.MonkeyPatch.context() as mp,
            recording_qnn_ops(mp) as emitted,
            not_delegated_lines() as lines,
        ):
            compiled = harness.lower_program(built.program, soc)
        stats["lowering seconds"] += round(time.perf_counter() - start)
        (row,) = compiled.report.rows
        assert [rule_of(r) for r in lines] == ([want] if want else []), config.describe()
        assert row.delegated == (want is None), f"{config.describe()} on {soc}: {row.reason}"
        stats["examples"] += 1
        stats[want or "delegated"] += 1

        expected = built.expected(built.inputs)
        magnitude = built.magnitude(built.inputs)
        if not row.delegated:
            assert not [op for op in emitted if op.type in TRANSPOSE_CONVS]
        if row.delegated:
            assert harness.delegate_count(compiled.edge) == 1
            if config.output_mask[0]:
                check_emitted(emitted, built, "3")
            actual = compiled.run(built.inputs)
            ratio = cases.assert_matches(
                actual, expected, magnitude, cases.FP16_RTOL, config.describe()
            )
            WORST["3: simulator vs torch (x FP16_RTOL of magnitude)"] = max(
                WORST["3: simulator vs torch (x FP16_RTOL of magnitude)"], ratio
            )
            WORST["3: simulator vs torch, max abs error"] = max(
                WORST["3: simulator vs torch, max abs error"],
                max(float((a - e).abs().max()) for a, e in zip(actual, expected)),
            )
            WORST["3: max |grad_input| compared"] = max(
                WORST["3: max |grad_input| compared"], float(expected[0].abs().max())
            )
        elif config.spatial_dims in (1, 2):  # a 1-D node is lifted to 2-D (passes/conv1d.py)
            actual = compiled.run(built.inputs)
            ratio = cases.assert_matches(
                actual, expected, magnitude, cases.cpu_rtol(config), config.describe()
            )
            stats["fallback run on CPU"] += 1
            WORST["3: CPU fallback vs torch (x cpu_rtol)"] = max(
                WORST["3: CPU fallback vs torch (x cpu_rtol)"], ratio
            )
        else:
            # executorch's portable kernel computes 2-D convolution_backward only and
            # a 3-D node cannot be lifted (tests/test_gates.py shows it refusing).
            stats["fallback not run (3-D; CPU kernel is 2-D only)"] += 1

    run()
    assert stats["examples"] >= n


# --- summary -------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def property_summary(request):
    start = time.perf_counter()
    yield
    if not STATS:
        return
    summary = {
        "seconds": round(time.perf_counter() - start, 1),
        "slow": bool(request.config.getoption("--slow")),
        "capabilities": sorted(support.CAPABILITIES),
        "tiers": {tier: dict(sorted(counts.items())) for tier, counts in sorted(STATS.items())},
        "worst": {k: float(f"{v:.3g}") for k, v in sorted(WORST.items())},
    }
    cache = getattr(request.config, "cache", None)
    if cache is not None:
        cache.set("qnn_convbwd/property_stats", summary)
    plugins = request.config.pluginmanager
    reporter = plugins.get_plugin("terminalreporter")
    capture = plugins.get_plugin("capturemanager")
    if reporter is not None:
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            reporter.write_line("")
            reporter.write_line("qnn_convbwd property summary:")
            for line in json.dumps(summary, indent=2).splitlines():
                reporter.write_line("  " + line)


# --- the model has teeth ----------------------------------------------------------------------


def test_model_notices_any_wrong_parameter():
    """Each single wrong TransposeConv2d / Pad parameter changes the modelled grad_input."""
    config = cases.ConvConfig(
        in_channels=4, out_channels=6, kernel=(3, 2), input_size=(10, 10), stride=(2, 3),
        padding=(1, 0), groups=2,
    )  # fmt: skip
    built = cases.build(config, seed=3)
    conv = geo.parse(cases.conv_backward_nodes(built.program.graph)[0])
    (want, *_), (scale, *_) = reference64(built), magnitude64(built)

    def emitted_for(plan) -> list[EmittedOp]:
        tconv_in = "grad_output"
        ops = []
        shape = [int(v) for v in built.inputs[0].movedim(1, -1).shape]  # NHWC
        for dim, factor in enumerate(plan.zero_insert):
            if factor == 1:
                continue
            amounts = [[0, 0] for _ in shape]
            amounts[dim + 2][1] = (factor - 1) * shape[dim + 2]
            pad, reshape = f"tconv_upsampled{dim}_pad_op", f"tconv_upsampled{dim}_reshape"
            ops.append(EmittedOp(pad, "Pad", {"pad_amount": amounts}, [tconv_in], [f"p{dim}"]))
            shape[dim + 1] *= factor
            ops.append(EmittedOp(reshape, "Reshape", {}, [f"p{dim}"], [f"u{dim}"], [list(shape)]))
            tconv_in = f"u{dim}"
        if any(plan.grad_output_pad_end):
            amounts = [[0, 0], *([0, e] for e in plan.grad_output_pad_end), [0, 0]]
            ops.append(
                EmittedOp("tconv_pad", "Pad", {"pad_amount": amounts}, [tconv_in], ["padded"])
            )
            tconv_in = "padded"
        params = {
            "stride": list(plan.stride),
            "pad_amount": [list(p) for p in plan.pad_amount],
            "output_padding": list(plan.output_padding),
            "group": plan.groups,
        }
        ops.append(EmittedOp("tconv", "TransposeConv2d", params, [tconv_in, "w"], ["grad_input"]))
        return ops

    def off_by(plan) -> float:
        try:
            got = emitted_grad_input(emitted_for(plan), built)
        except RuntimeError:  # e.g. groups that do not divide the channels
            return math.inf
        return math.inf if got.shape != want.shape else ratio_to_magnitude(got, want, scale)

    upsampled = geo.plan_input_gradient(conv, "auto", "zero_insert")
    assert off_by(upsampled) < 1e-12 and upsampled.zero_insert == (2, 3)
    for bad in [
        dataclasses.replace(upsampled, zero_insert=(2, 2)),
        dataclasses.replace(upsampled, zero_insert=(1, 3), stride=(2, 1)),
        dataclasses.replace(upsampled, pad_amount=((0, 2), *upsampled.pad_amount[1:])),
        dataclasses.replace(upsampled, groups=1),
    ]:
        assert off_by(bad) > 1e-3, f"zero_insert: {bad} not noticed"
    for mode in ("parameter", "fold"):
        plan = geo.plan_input_gradient(conv, mode, "parameter")
        assert off_by(plan) < 1e-12, mode
        # output_padding (1, 2): with "fold" the second one reaches beyond the full extent.
        assert any(plan.output_padding if mode == "parameter" else plan.grad_output_pad_end)
        wrong = [
            dataclasses.replace(plan, stride=(plan.stride[0], plan.stride[1] - 1)),
            dataclasses.replace(plan, pad_amount=((2, 1), *plan.pad_amount[1:])),
            dataclasses.replace(plan, pad_amount=(*plan.pad_amount[:1], (1, 0))),
            dataclasses.replace(plan, groups=1),
        ]
        if mode == "parameter":
            wrong.append(dataclasses.replace(plan, output_padding=(0, 0)))
        else:
            wrong.append(dataclasses.replace(plan, grad_output_pad_end=(0, 0)))
        for bad in wrong:
            assert off_by(bad) > 1e-3, f"{mode}: {bad} not noticed"
