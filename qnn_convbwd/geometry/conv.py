"""Arguments of ``aten.convolution_backward`` and the transposed convolution that
computes its input gradient, derived generically over the spatial dimensions.

Schema: https://github.com/pytorch/pytorch/blob/main/aten/src/ATen/native/native_functions.yaml
(``convolution_backward``). Shapes are NC<spatial>: grad_output is
``[N, C_out, *out]``, input ``[N, C_in, *in]``, weight ``[C_out, C_in / groups, *k]``.

Layout names used across the package, written for the 2-D case; with three
spatial dims the kernel dims are ``kD, kH, kW`` (OIDHW, DHWIO, DHWOI) and the
names below stand for those layouts too:

* ``OIHW``: torch convolution weight ``[C_out, C_in/g, kH, kW]``.
* ``HWIO``: QNN Conv2d / Conv3d filter ``[kH, kW, C_in/g, C_out]`` = OIHW permuted
  by ``oihw_to_hwio`` ((2, 3, 1, 0) in 2-D). executorch's forward convolution
  visitor stores the static weight in this layout.
* ``HWOI``: QNN TransposeConv2d / TransposeConv3d filter for the input gradient.
  TransposeConv takes ``[kH, kW, C_in_t, C_out_t / g]``; the backward convolution
  reads ``C_in_t = C_out`` channels and produces ``C_out_t = C_in`` channels, so
  its filter is ``[kH, kW, C_out, C_in/g]`` = HWIO permuted by ``hwio_to_hwoi``
  ((0, 1, 3, 2) in 2-D).
* ``NHWC``: activations inside QNN (NDHWC with three spatial dims).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import torch

from .. import options

# Argument positions in convolution_backward's schema.
GRAD_OUTPUT, INPUT, WEIGHT, BIAS_SIZES, STRIDE, PADDING, DILATION = range(7)
TRANSPOSED, OUTPUT_PADDING, GROUPS, OUTPUT_MASK = range(7, 11)
# ... and in the forward convolution's (input, weight, bias, stride, padding,
# dilation, transposed, output_padding, groups).
F_INPUT, F_WEIGHT, F_BIAS, F_STRIDE, F_PADDING, F_DILATION = range(6)
F_TRANSPOSED, F_OUTPUT_PADDING, F_GROUPS = range(6, 9)


def oihw_to_hwio(spatial: int) -> tuple[int, ...]:
    """Permutation of a torch weight ``[O, I, *k]`` to the QNN filter ``[*k, I, O]``."""
    return (*range(2, 2 + spatial), 1, 0)


def hwio_to_hwoi(spatial: int) -> tuple[int, ...]:
    """Permutation of ``[*k, I, O]`` to ``[*k, O, I]``: the last two dims exchanged."""
    return (*range(spatial), spatial + 1, spatial)


OIHW_TO_HWIO = oihw_to_hwio(2)
HWIO_TO_HWOI = hwio_to_hwoi(2)


class ConvArgumentError(ValueError):
    """The node's arguments cannot describe a convolution backward we understand."""


def _per_dim(name: str, values: Sequence[int], spatial: int) -> tuple[int, ...]:
    """One rule for every per-dimension argument: length 1 broadcasts, length n is taken."""
    values = tuple(int(v) for v in values)
    if len(values) == 1:
        return values * spatial
    if len(values) != spatial:
        raise ConvArgumentError(f"{name} has {len(values)} entries for {spatial} spatial dims")
    return values


def _static(shape: Sequence) -> tuple[int, ...] | None:
    if any(not isinstance(d, int) for d in shape):
        return None
    return tuple(shape)


@dataclasses.dataclass(frozen=True)
class ConvBackward:
    """Everything the support rules and the visitor need to know about one node."""

    grad_output_shape: tuple
    input_shape: tuple
    weight_shape: tuple
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    transposed: bool
    output_padding_arg: tuple[int, ...]
    groups: int
    output_mask: tuple[bool, bool, bool]
    dtype: torch.dtype

    @property
    def rank(self) -> int:
        return len(self.grad_output_shape)

    @property
    def spatial_dims(self) -> int:
        return self.rank - 2

    @property
    def kernel(self) -> tuple[int, ...]:
        return tuple(self.weight_shape[2:])

    @property
    def in_channels(self) -> int:
        return int(self.input_shape[1])

    @property
    def out_channels(self) -> int:
        return int(self.weight_shape[0])

    @property
    def is_static(self) -> bool:
        return all(
            _static(s) is not None
            for s in (self.grad_output_shape, self.input_shape, self.weight_shape)
        )

    @property
    def is_depthwise(self) -> bool:
        """Every group reads one input channel (MobileNet-style)."""
        return self.groups > 1 and self.groups == self.in_channels

    @property
    def is_pointwise(self) -> bool:
        """A one-tap kernel, no padding, one group: each output element reads one input
        element (at ``y * s`` per spatial dim), so grad_weight is a matrix product
        (``builders/weight_gradient.py``). Dilation moves no tap of a one-tap kernel."""
        return (
            not self.transposed
            and self.groups == 1
            and all(k == 1 for k in self.kernel)
            and not any(self.padding)
        )

    def transposed_output_padding(self) -> tuple[int, ...]:
        """output_padding of the transposed conv that maps grad_output back to input's size.

        A transposed convolution produces ``(o - 1) * s - 2 p + d (k - 1) + 1 + op``
        elements per dim; ``op`` makes up what the forward convolution's floor
        division dropped (odd sizes with stride 2 need 1).
        """
        return tuple(
            i - ((o - 1) * s - 2 * p + d * (k - 1) + 1) for i, o, s, p, d, k in self.per_dim()
        )

    def per_dim(self) -> list[tuple[int, int, int, int, int, int]]:
        """Per spatial dim: (input size, grad_output size, stride, padding, dilation, kernel)."""
        return [
            (int(i), int(o), s, p, d, k)
            for i, o, s, p, d, k in zip(
                self.input_shape[2:],
                self.grad_output_shape[2:],
                self.stride,
                self.padding,
                self.dilation,
                self.kernel,
            )
        ]

    def with_spatial_order(self, order: Sequence[int]) -> ConvBackward:
        """The same convolution with its spatial dims taken in ``order``."""

        def spatial(values: Sequence) -> tuple:
            return tuple(values[i] for i in order)

        def shape(values: Sequence) -> tuple:
            return (*values[:2], *spatial(values[2:]))

        return dataclasses.replace(
            self,
            grad_output_shape=shape(self.grad_output_shape),
            input_shape=shape(self.input_shape),
            weight_shape=shape(self.weight_shape),
            stride=spatial(self.stride),
            padding=spatial(self.padding),
            dilation=spatial(self.dilation),
            output_padding_arg=spatial(self.output_padding_arg),
        )

    def describe(self) -> dict:
        return {
            "grad_output": list(self.grad_output_shape),
            "input": list(self.input_shape),
            "weight": list(self.weight_shape),
            "stride": list(self.stride),
            "padding": list(self.padding),
            "dilation": list(self.dilation),
            "groups": self.groups,
            "transposed": self.transposed,
            "output_mask": list(self.output_mask),
        }


def parse(node: torch.fx.Node) -> ConvBackward:
    """Read a convolution_backward node's arguments and shapes; raise ConvArgumentError."""
    args = node.args
    if len(args) != 11:
        raise ConvArgumentError(f"expected 11 arguments, got {len(args)}")
    vals = []
    for idx in (GRAD_OUTPUT, INPUT, WEIGHT):
        arg = args[idx]
        val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor):
            raise ConvArgumentError(f"argument {idx} carries no tensor metadata")
        vals.append(val)
    grad_output, inp, weight = vals
    if not (grad_output.dim() == inp.dim() == weight.dim()) or grad_output.dim() < 3:
        raise ConvArgumentError(
            f"ranks differ or are below 3: grad_output {grad_output.dim()}, "
            f"input {inp.dim()}, weight {weight.dim()}"
        )
    spatial = grad_output.dim() - 2
    mask = tuple(bool(m) for m in args[OUTPUT_MASK])
    if len(mask) != 3:
        raise ConvArgumentError(f"output_mask has {len(mask)} entries")
    return ConvBackward(
        grad_output_shape=tuple(grad_output.shape),
        input_shape=tuple(inp.shape),
        weight_shape=tuple(weight.shape),
        stride=_per_dim("stride", args[STRIDE], spatial),
        padding=_per_dim("padding", args[PADDING], spatial),
        dilation=_per_dim("dilation", args[DILATION], spatial),
        transposed=bool(args[TRANSPOSED]),
        output_padding_arg=_per_dim("output_padding", args[OUTPUT_PADDING], spatial),
        groups=int(args[GROUPS]),
        output_mask=mask,  # type: ignore[arg-type]
        dtype=grad_output.dtype,
    )


def transpose_conv_applies_groups(spatial_dims: int) -> bool:
    """Whether the HTP's TransposeConv op for this many spatial dims honours ``group``.

    Measured on the QAIRT 2.51 x86-64 simulator (V69 to V81): TransposeConv3d
    ignores its group parameter. Given a filter ``[*k, C_in, C_out / g]`` and
    ``group = g`` it computes an ungrouped transposed convolution into the first
    ``C_out / g`` output channels and leaves the others zero (k=1, stride 1,
    fitted by least squares). TransposeConv2d applies it.
    """
    return spatial_dims != 3


@dataclasses.dataclass(frozen=True)
class TransposedConvPlan:
    """Parameters of the QNN TransposeConv, plus zeros appended to grad_output."""

    stride: tuple[int, ...]
    pad_amount: tuple[tuple[int, int], ...]  # per spatial dim: (begin, end) cropped
    output_padding: tuple[int, ...]
    grad_output_pad_end: tuple[int, ...]  # zero rows/cols appended to grad_output
    groups: int  # the op's group parameter
    # Groups folded into a block-diagonal filter (the op then runs ungrouped); 1: none.
    dense_groups: int = 1
    # "crop": per spatial dim, the op's output size and the (begin, end) slice of it
    # that is grad_input; empty when the op's parameters crop.
    full_size: tuple[int, ...] = ()
    result_slice: tuple[tuple[int, int], ...] = ()
    # Per spatial dim: grad_output is upsampled by this factor first, each element
    # followed by ``factor - 1`` zeros (1: not upsampled). See STRIDE_MODES.
    zero_insert: tuple[int, ...] = ()
    # Upsample the TransposeConv2d's output instead of its input (where every
    # upsampled dim has a kernel of 1, the two commute), then crop ``output_crop``.
    upsample_output: bool = False
    output_crop: tuple[tuple[int, int], ...] = ()

    @property
    def upsamples(self) -> bool:
        return any(f > 1 for f in self.zero_insert)

    @property
    def uses_output_padding(self) -> bool:
        return any(self.output_padding)


def own_filter_reason(conv: ConvBackward) -> str | None:
    """Why grad_input cannot read the shared HWIO weight through a Transpose (None: it can).

    A dilated kernel (TransposeConv has no dilation parameter) and groups the op
    does not apply both need a filter with zeros inserted: from a static weight, a
    static tensor of its own.
    """
    if any(d != 1 for d in conv.dilation):
        return "a dilated convolution_backward builds its own (dilated) filter"
    return dense_filter_reason(conv)


def dense_filter_reason(conv: ConvBackward) -> str | None:
    """Why grad_input needs a block-diagonal filter, which only a static weight can give
    (None: it does not). A dilated filter, unlike it, can be built in the graph from a
    run-time weight."""
    if conv.groups > 1 and not transpose_conv_applies_groups(conv.spatial_dims):
        return (
            f"a grouped {conv.spatial_dims}-D convolution_backward builds its own "
            "block-diagonal filter (the TransposeConv op ignores groups)"
        )
    return None


def _op_groups(conv: ConvBackward) -> dict[str, int]:
    if transpose_conv_applies_groups(conv.spatial_dims):
        return {"groups": conv.groups, "dense_groups": 1}
    return {"groups": 1, "dense_groups": conv.groups}


# The modes of Options.output_padding and Options.stride (explained there).
OUTPUT_PADDING_MODES = options.OUTPUT_PADDING_MODES
STRIDE_MODES = options.STRIDE_MODES


def transpose_conv_takes_strides(spatial_dims: int, stride: Sequence[int]) -> bool:
    """Whether the HTP's TransposeConv op computes right with these strides.

    Measured on the QAIRT 2.51 x86-64 simulator (V69 to V81): TransposeConv3d
    (NDHWC) is wrong when its H and W strides differ ((1, 2, 1), (2, 2, 1):
    errors as large as the outputs; delta kernels show the W dim stepped by the
    H stride) or fails to compile ((1, 1, 2), (2, 1, 2)); the D stride is free.
    TransposeConv2d takes any strides.
    """
    return spatial_dims != 3 or stride[-2] == stride[-1]


def transpose_conv_spatial_order(conv: ConvBackward) -> tuple[int, ...] | None:
    """The order of the spatial dims in which grad_input's TransposeConv runs.

    The identity where the op takes the strides as they are; otherwise the first
    reordering it takes (for 3-D: the dims with equal strides moved to H and W,
    grad_output and grad_input transposed around the op). None: no order works
    (three different strides in 3-D).
    """
    for order in itertools.permutations(range(conv.spatial_dims)):  # the identity first
        if transpose_conv_takes_strides(conv.spatial_dims, [conv.stride[i] for i in order]):
            return order
    return None


def inverse_order(order: Sequence[int]) -> tuple[int, ...]:
    return tuple(sorted(range(len(order)), key=lambda i: order[i]))


def transpose_conv_applies_padding(spatial_dims: int) -> bool:
    """Whether the HTP's TransposeConv op for this many spatial dims crops as told.

    Measured on the QAIRT 2.51 x86-64 simulator (V73, delta kernels): TransposeConv3d
    crops the D dim by the H dim's pad_amount (pads (0, 1, 1) crop D by 1, (1, 0, 0)
    by 0); equal pads in all three dims are right. TransposeConv2d crops as told.
    """
    return spatial_dims != 3


def parameter_is_reliable(conv: ConvBackward) -> bool:
    """Whether the HTP computes TransposeConv2d's output_padding right for this conv.

    Measured on the QAIRT 2.51 x86-64 simulator: wrong for depthwise convolutions
    with output_padding > 0, and wrong (garbage, or a failed compile) whenever the
    output padding reaches beyond the transposed convolution's full extent
    (output_padding > padding), for any groups.
    """
    op = conv.transposed_output_padding()
    if not any(op):
        return True
    return not conv.is_depthwise and all(o <= p for o, p in zip(op, conv.padding))


def plan_input_gradient(
    conv: ConvBackward, mode: str = "auto", stride: str = "zero_insert"
) -> TransposedConvPlan:
    """Transposed-convolution parameters that compute grad_input.

    ``stride="zero_insert"`` (where some stride is > 1): grad_output of size ``o``
    is upsampled to ``o s`` (element j at ``j s``, zeros between and after), so
    a stride-1 transposed convolution spans ``o s - 1 + d (k - 1) + 1``; cropping
    ``p`` at the start and whatever exceeds the input size ``i`` at the end
    (``s - 1 + p - op >= p``) leaves grad_input. ``mode`` does not apply then.
    Where every strided dim has a kernel of 1 (a 1x1 downsampling conv), a
    kernel-1 convolution commutes with the upsampling: the transposed
    convolution runs on grad_output as it is (``s^d`` times fewer multiply-adds)
    and its output is upsampled and cropped the same way. 3-D convolutions keep
    the op's stride (see below).

    Otherwise (``stride="parameter"``, or every stride 1) the transposed
    convolution has the forward stride. It produces its full extent
    ``(o - 1) s + k`` (dilation 1) and then crops ``pad_amount`` at both ends;
    the output padding ``op`` crops ``op`` fewer elements at the end, and
    ``mode`` says how that is expressed. "fold" expresses it without
    the parameter: where ``op <= p`` the end crop is simply ``p - op``; where
    ``op > p`` the missing elements lie beyond the full extent and are zero, so
    one zero row is appended to grad_output (which extends the full extent by
    ``s``) and the end crop becomes ``s + p - op``.
    """
    if mode not in OUTPUT_PADDING_MODES:
        raise ValueError(f"output_padding mode {mode!r} is not one of {OUTPUT_PADDING_MODES}")
    if stride not in STRIDE_MODES:
        raise ValueError(f"stride mode {stride!r} is not one of {STRIDE_MODES}")
    unit = (1,) * conv.spatial_dims
    # The zero-insertion plan crops through pad_amount, which TransposeConv3d
    # applies wrongly (transpose_conv_applies_padding): 3-D keeps the op's stride.
    # "phases" (geometry/phases.py) takes this plan where it does not apply.
    upsample = stride in ("zero_insert", "phases") and transpose_conv_applies_padding(
        conv.spatial_dims
    )
    if upsample and any(s > 1 for s in conv.stride):
        dims = conv.per_dim()
        after = all(d * (k - 1) + 1 == 1 for _, _, s, _, d, k in dims if s > 1)
        pad_amount, crop = [], []
        for i, o, s, p, d, k in dims:
            if after and s > 1:  # kernel 1: the convolution keeps o, the upsampling crops
                pad_amount.append((0, 0))
                crop.append((p, o * s - p - i))
                continue
            extent = (o if after else o * s) - 1 + d * (k - 1) + 1
            pad_amount.append((p, extent - p - i))
            crop.append((0, 0))
        return TransposedConvPlan(
            stride=unit,
            pad_amount=tuple(pad_amount),
            output_padding=(0,) * conv.spatial_dims,
            grad_output_pad_end=(0,) * conv.spatial_dims,
            **_op_groups(conv),
            zero_insert=tuple(conv.stride),
            upsample_output=after,
            output_crop=tuple(crop),
        )
    op = conv.transposed_output_padding()
    if mode == "crop" or (mode == "auto" and not transpose_conv_applies_padding(conv.spatial_dims)):
        return _crop_plan(conv, op)
    if mode == "parameter" or (mode == "auto" and parameter_is_reliable(conv)):
        return TransposedConvPlan(
            stride=conv.stride,
            pad_amount=tuple((p, p) for p in conv.padding),
            output_padding=op,
            grad_output_pad_end=(0,) * conv.spatial_dims,
            **_op_groups(conv),
            zero_insert=unit,
        )
    pad_amount, extend = [], []
    for p, o, s in zip(conv.padding, op, conv.stride):
        if o <= p:
            pad_amount.append((p, p - o))
            extend.append(0)
        else:
            pad_amount.append((p, s + p - o))
            extend.append(1)
    return TransposedConvPlan(
        stride=conv.stride,
        pad_amount=tuple(pad_amount),
        output_padding=(0,) * conv.spatial_dims,
        grad_output_pad_end=tuple(extend),
        **_op_groups(conv),
        zero_insert=unit,
    )


def _crop_plan(conv: ConvBackward, op: tuple[int, ...]) -> TransposedConvPlan:
    """The op uncropped; grad_input sliced out of its full extent.

    The full extent is ``(o - 1) s + d (k - 1) + 1 = i + 2p - op``; grad_input is
    ``[p, p + i)`` of it. Where ``op > p`` that reaches past the end: one zero
    row appended to grad_output extends the full extent by ``s > op - p``.
    """
    full, extend, slices = [], [], []
    for (i, o, s, p, d, k), pad_out in zip(conv.per_dim(), op):
        extra = 1 if pad_out > p else 0
        full.append((o + extra - 1) * s + d * (k - 1) + 1)
        extend.append(extra)
        slices.append((p, p + i))
    return TransposedConvPlan(
        stride=conv.stride,
        pad_amount=((0, 0),) * conv.spatial_dims,
        output_padding=(0,) * conv.spatial_dims,
        grad_output_pad_end=tuple(extend),
        full_size=tuple(full),
        result_slice=tuple(slices),
        **_op_groups(conv),
    )


@dataclasses.dataclass(frozen=True)
class WeightGradPlan:
    """The Conv2d / Conv3d that computes grad_weight (see builders/weight_gradient.py)."""

    stride: tuple[int, ...]  # the forward dilation
    dilation: tuple[int, ...]  # the op's dilation parameter: the forward stride, or 1s
    pad_amount: tuple[tuple[int, int], ...]
    output_size: tuple[int, ...]  # >= kernel; the excess is sliced off
    # Where the op has no dilation: zeros inserted between the filter's taps
    # (grad_output's elements) per spatial dim; 1: none.
    filter_zero_stuffing: tuple[int, ...] = ()
    # The kernel taps the op computes, per spatial dim (``kernel`` of the forward
    # convolution, or fewer: ``padding_reaches_filter``), and the zero taps a Pad adds
    # before and after them to make the forward kernel.
    taps: tuple[int, ...] = ()
    zero_taps: tuple[tuple[int, int], ...] = ()

    @property
    def stuffs_filter(self) -> bool:
        return any(z > 1 for z in self.filter_zero_stuffing)


def conv_applies_dilation(spatial_dims: int) -> bool:
    """Whether the HTP's Conv op for this many spatial dims accepts a dilation > 1.

    Measured on the QAIRT 2.51 x86-64 simulator: Conv3d with dilation 2 fails
    QNN op validation ("has incorrect Value 2, expected equal to 1"); Conv2d
    accepts it.
    """
    return spatial_dims != 3


def padding_reaches_filter(pads: Sequence[tuple[int, int]], extents: Sequence[int]) -> bool:
    """Whether a Conv2d / Conv3d with these pad amounts and filter extents (per spatial
    dim) hits the HTP's padding defect: a padding at one end at least the filter's
    extent, that being more than one tap (some outputs then read padding only).

    Measured on the QAIRT 2.51 x86-64 simulator, SM8650: such a convolution is
    garbage, with the padding as the op's parameter or as a Pad op before it (relative
    L2 16-21 for a static 2x2 filter with padding 2 and a 3x3 one with padding 3,
    depthwise or dense, through executorch's own visitor; grad_weight of a 5x5 /
    padding 2 convolution at 2x2 and of a 7x7 / padding 3 one at 3x3, whose runtime
    filter is grad_output: all zeros, or values up to 7e5, and a segfault in
    libQnnHtp.so for MobileNetV3-Small fully trained at 32 px). A 1-tap filter with
    any padding and a 2x2 filter with padding 1 are right.
    """
    return any(e > 1 and max(p) >= e for p, e in zip(pads, extents))


def forward_padding_reaches_kernel(node) -> tuple[tuple[int, ...], list[int]] | None:
    """``(padding, kernel extents)`` of a forward ``aten.convolution`` node that hits
    ``padding_reaches_filter``; None for one that does not (or a transposed one)."""
    weight = node.args[1]
    if node.args[6] or "val" not in getattr(weight, "meta", {}):
        return None
    kernel = [int(k) for k in weight.meta["val"].shape[2:]]
    padding = _per_dim("padding", node.args[4], len(kernel))
    dilation = _per_dim("dilation", node.args[5], len(kernel))
    extents = [d * (k - 1) + 1 for k, d in zip(kernel, dilation)]
    if not padding_reaches_filter([(p, p) for p in padding], extents):
        return None
    return padding, extents


def _data_taps(i: int, o: int, s: int, p: int, d: int, k: int) -> tuple[int, int]:
    """First and last kernel tap whose window reads input data, not only padding."""
    taps = [a for a in range(k) if any(0 <= y * s + a * d - p < i for y in range(o))]
    return taps[0], taps[-1]


def plan_weight_gradient(conv: ConvBackward) -> WeightGradPlan:
    """Convolution of the batch/channel-swapped input with grad_output as filter.

    The filter spans ``(o - 1) s + 1`` input elements (size o, dilation s), read
    at every ``d``-th position. With the forward padding at both ends it yields
    ``k + r // d`` positions, where ``r = i + 2p - d (k - 1) - 1 - (o - 1) s`` is
    what the forward convolution's floor division dropped; the end padding is
    reduced by r where it can be, and anything left over is sliced off. Where
    the op takes no dilation (``conv_applies_dilation``), the filter is dilated
    by inserting ``s - 1`` zeros between its elements instead: same extent, same
    output.
    """
    pads, sizes, extents = [], [], []
    for i, o, s, p, d, k in conv.per_dim():
        dropped = i + 2 * p - d * (k - 1) - 1 - (o - 1) * s
        end = max(p - dropped, 0)
        pads.append((p, end))
        sizes.append((i + p + end - (o - 1) * s - 1) // d + 1)
        extents.append((o - 1) * s + 1)
    taps, zero_taps = conv.kernel, ((0, 0),) * conv.spatial_dims
    if padding_reaches_filter(pads, extents):
        # Compute only the taps that read data (the others are exactly zero), with
        # the padding those need, which stays below the filter's extent.
        pads, sizes, taps, zero_taps = [], [], [], []
        for (i, o, s, p, d, k), extent in zip(conv.per_dim(), extents):
            first, last = _data_taps(i, o, s, p, d, k)
            count, begin = last - first + 1, p - first * d
            end = max(0, (count - 1) * d + extent - i - begin)
            pads.append((begin, end))
            sizes.append((i + begin + end - extent) // d + 1)
            taps.append(count)
            zero_taps.append((first, k - 1 - last))
    if conv_applies_dilation(conv.spatial_dims):
        dilation, stuffing = conv.stride, (1,) * conv.spatial_dims
    else:
        dilation, stuffing = (1,) * conv.spatial_dims, conv.stride
    return WeightGradPlan(
        stride=conv.dilation,
        dilation=dilation,
        pad_amount=tuple(pads),
        output_size=tuple(sizes),
        filter_zero_stuffing=stuffing,
        taps=tuple(taps),
        zero_taps=tuple(zero_taps),
    )
