"""Arguments of ``aten.convolution_backward`` and the transposed convolution that
computes its input gradient, derived generically over the spatial dimensions.

Schema: https://github.com/pytorch/pytorch/blob/main/aten/src/ATen/native/native_functions.yaml
(``convolution_backward``). Shapes are NC<spatial>: grad_output is
``[N, C_out, *out]``, input ``[N, C_in, *in]``, weight ``[C_out, C_in / groups, *k]``.

Layout names used across the package (4-D case):

* ``OIHW``: torch convolution weight ``[C_out, C_in/g, kH, kW]``.
* ``HWIO``: QNN Conv2d filter ``[kH, kW, C_in/g, C_out]`` = OIHW permuted (2, 3, 1, 0).
  executorch's forward Conv2d visitor stores the static weight in this layout.
* ``HWOI``: QNN TransposeConv2d filter for the input gradient. TransposeConv2d
  takes ``[kH, kW, C_in_t, C_out_t / g]``; the backward convolution reads
  ``C_in_t = C_out`` channels and produces ``C_out_t = C_in`` channels, so its
  filter is ``[kH, kW, C_out, C_in/g]`` = HWIO permuted (0, 1, 3, 2).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from .. import options

# Argument positions in the schema.
GRAD_OUTPUT, INPUT, WEIGHT, BIAS_SIZES, STRIDE, PADDING, DILATION = range(7)
TRANSPOSED, OUTPUT_PADDING, GROUPS, OUTPUT_MASK = range(7, 11)

OIHW_TO_HWIO = (2, 3, 1, 0)
HWIO_TO_HWOI = (0, 1, 3, 2)


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

    def transposed_output_padding(self) -> tuple[int, ...]:
        """output_padding of the transposed conv that maps grad_output back to input's size.

        A transposed convolution produces ``(o - 1) * s - 2 p + d (k - 1) + 1 + op``
        elements per dim; ``op`` makes up what the forward convolution's floor
        division dropped (odd sizes with stride 2 need 1).
        """
        return tuple(
            int(i) - ((int(o) - 1) * s - 2 * p + d * (k - 1) + 1)
            for i, o, s, p, d, k in zip(
                self.input_shape[2:],
                self.grad_output_shape[2:],
                self.stride,
                self.padding,
                self.dilation,
                self.kernel,
            )
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


@dataclasses.dataclass(frozen=True)
class TransposedConvPlan:
    """Parameters of the QNN TransposeConv2d, plus zeros appended to grad_output."""

    stride: tuple[int, ...]
    pad_amount: tuple[tuple[int, int], ...]  # per spatial dim: (begin, end) cropped
    output_padding: tuple[int, ...]
    grad_output_pad_end: tuple[int, ...]  # zero rows/cols appended to grad_output
    groups: int
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


# The modes of Options.output_padding and Options.stride (explained there).
OUTPUT_PADDING_MODES = options.OUTPUT_PADDING_MODES
STRIDE_MODES = options.STRIDE_MODES


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
    and its output is upsampled and cropped the same way.

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
    if stride == "zero_insert" and any(s > 1 for s in conv.stride):
        dims = list(
            zip(
                conv.input_shape[2:],
                conv.grad_output_shape[2:],
                conv.stride,
                conv.padding,
                conv.dilation,
                conv.kernel,
            )
        )
        after = all(d * (k - 1) + 1 == 1 for _, _, s, _, d, k in dims if s > 1)
        pad_amount, crop = [], []
        for i, o, s, p, d, k in dims:
            i, o = int(i), int(o)
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
            groups=conv.groups,
            zero_insert=tuple(conv.stride),
            upsample_output=after,
            output_crop=tuple(crop),
        )
    op = conv.transposed_output_padding()
    if mode == "parameter" or (mode == "auto" and parameter_is_reliable(conv)):
        return TransposedConvPlan(
            stride=conv.stride,
            pad_amount=tuple((p, p) for p in conv.padding),
            output_padding=op,
            grad_output_pad_end=(0,) * conv.spatial_dims,
            groups=conv.groups,
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
        groups=conv.groups,
        zero_insert=unit,
    )


@dataclasses.dataclass(frozen=True)
class WeightGradPlan:
    """The Conv2d that computes grad_weight (see builders/weight_gradient.py)."""

    stride: tuple[int, ...]  # the forward dilation
    dilation: tuple[int, ...]  # the forward stride
    pad_amount: tuple[tuple[int, int], ...]
    output_size: tuple[int, ...]  # >= kernel; the excess is sliced off


def plan_weight_gradient(conv: ConvBackward) -> WeightGradPlan:
    """Conv2d of the batch/channel-swapped input with grad_output as filter.

    The filter spans ``(o - 1) s + 1`` input elements (size o, dilation s), read
    at every ``d``-th position. With the forward padding at both ends it yields
    ``k + r // d`` positions, where ``r = i + 2p - d (k - 1) - 1 - (o - 1) s`` is
    what the forward convolution's floor division dropped; the end padding is
    reduced by r where it can be, and anything left over is sliced off.
    """
    pads, sizes = [], []
    for i, o, s, p, d, k in zip(
        conv.input_shape[2:],
        conv.grad_output_shape[2:],
        conv.stride,
        conv.padding,
        conv.dilation,
        conv.kernel,
    ):
        dropped = int(i) + 2 * p - d * (k - 1) - 1 - (int(o) - 1) * s
        end = max(p - dropped, 0)
        pads.append((p, end))
        sizes.append((int(i) + p + end - (int(o) - 1) * s - 1) // d + 1)
    return WeightGradPlan(
        stride=conv.dilation,
        dilation=conv.stride,
        pad_amount=tuple(pads),
        output_size=tuple(sizes),
    )
