"""QNN lowering of a forward ``aten.max_pool2d_with_indices`` whose indices are used.

executorch's visitor builds PoolMax2d for the values only and refuses a pool
whose indices (getitem 1) have a user. In a training graph the indices feed the
pool's backward; when that backward is delegated too (``partition.max_pool``
``decide_forward``), this visitor computes them in the graph, exactly as
torch's CPU kernel does: the *first* maximum in the window's row-major scan
order (kernel offsets ``j``, last dim fastest), as the flat position ``h * W + w``
in the pool's input plane (which is the -inf padded plane after executorch's
RecomposePadMaxPool2d, what ``geometry.pool.IndexPlane`` records for the
backward). NHWC activations::

    canvas   = Pad(x, -inf)                 # only where padding / ceil_mode need it
    values   = PoolMax2d(canvas)            # ElementWiseMaximum chain when dilated or padded
    x_j      = StridedSlice(canvas, j * d, step s)   # what offset j of every window reads
    indices  = table_last
    indices  = ElementWiseSelect(ElementWiseEqual(x_j, values), table_j, indices)
               for j from the second-last offset down to the first: the last write wins

``table_j`` is the static int32 ``[1, *out, 1]`` of ``op_max_pool_backward.window_table``.
The equality is exact: PoolMax2d's (and Maximum's) output is one of its inputs,
in the same precision. The indices are int32 (QNN has no int64); they never
leave the delegate (the partition rule), so nothing reads them as torch's int64.

A padded canvas (this visitor's -inf Pad, or the ``constant_pad_nd`` executorch's
RecomposePadMaxPool2d puts before a padded pool) gets the ElementWiseMaximum chain for
its values, never PoolMax2d: QAIRT's PoolMax2d reading a Pad's output computes some
windows from values outside them (measured, QAIRT 2.51, V69 to V81: kernel 2 or 4,
stride 2, padding 1 on an even width, the last output column; docs/htp_defects.md).

A float pool whose indices are unused gets the same ElementWiseMaximum chain for its
values where it reads a Pad's output (``build_values``); every other pool whose indices
are unused (a quantized one included) is left to executorch's visitor (``original``,
PoolMax2d).
"""

from __future__ import annotations

import operator

import numpy as np
import torch

from .. import integration
from ..geometry import pool as pg
from ..meta import INDICES_CAST, INDICES_ON_HTP
from . import qnn_ops
from .op_max_pool_backward import window_table

TARGET = "aten.max_pool2d_with_indices.default"
CAST_TARGET = "dim_order_ops._to_dim_order_copy.default"  # executorch's visitor: op_to.py
# "pool_max" (default): PoolMax2d for the values where the pool is neither dilated nor
# padded (``reads_padding``); "maximum": the values as an ElementWiseMaximum chain over
# the slices (always).
VALUES = "pool_max"


def window_extent(pool: pg.MaxPoolBackward) -> tuple[int, ...]:
    """Per dim, the padded extent the windows read: ``(out - 1) * s + (k - 1) * d + 1``."""
    return tuple((o - 1) * s + (k - 1) * d + 1 for _, o, k, s, _, d in pool.per_dim())


def trailing_padding(pool: pg.MaxPoolBackward) -> tuple[int, ...]:
    """Per dim, the -inf the windows read past the input's end (ceil_mode's last windows)."""
    extent = window_extent(pool)
    return tuple(max(0, e - p - i) for e, p, i in zip(extent, pool.padding, pool.in_sizes))


class _Builder:
    def __init__(self, visitor, node, nodes_to_wrappers, pool: pg.MaxPoolBackward) -> None:
        self.visitor, self.node, self.n2w, self.pool = visitor, node, nodes_to_wrappers, pool
        self.ops: list = []
        self.batch, self.channels = int(pool.input_shape[0]), int(pool.input_shape[1])

    def name(self, suffix: str) -> str:
        return f"{self.node.name}_{suffix}"

    def tensor(self, suffix: str, sizes, dtype):
        shape = [self.batch, *sizes, self.channels]
        return qnn_ops.native_tensor(self.visitor, self.name(suffix), shape, dtype, self.n2w)

    def op(self, suffix: str, names_key: str, inputs, outputs):
        op = qnn_ops.new_op(self.name(suffix), integration.get(names_key).op_name, inputs, outputs)
        self.ops.append(op)
        return op

    def canvas(self, source):
        """The input with -inf where the windows read padding (torch's implicit -inf),
        cut to the windows' extent; ``source`` itself when it is exactly that."""
        pool, dtype = self.pool, self.pool.dtype
        extent = window_extent(pool)
        after = trailing_padding(pool)
        padded_sizes = [p + i + a for p, i, a in zip(pool.padding, pool.in_sizes, after)]
        if any(pool.padding) or any(after):
            padded = self.tensor("canvas_pad", padded_sizes, dtype)
            amounts = [[0, 0], *zip(pool.padding, after), [0, 0]]
            self.ops.append(
                qnn_ops.constant_pad(self.name("canvas_pad_op"), source, padded, amounts, -np.inf)
            )
            source = padded
        if list(padded_sizes) != list(extent):
            cut = self.tensor("canvas", extent, dtype)
            ranges = [[0, self.batch, 1], *([0, e, 1] for e in extent), [0, self.channels, 1]]
            self.ops.append(qnn_ops.strided_slice(self.name("canvas_op"), source, cut, ranges))
            source = cut
        return source

    def window_slice(self, canvas, number: int, offset):
        """What offset ``offset`` of every window reads: ``[N, *out, C]``."""
        pool = self.pool
        ranges = [[0, self.batch, 1]]
        for j, o, s, d in zip(offset, pool.out_sizes, pool.stride, pool.dilation):
            ranges.append([j * d, j * d + (o - 1) * s + 1, s])
        ranges.append([0, self.channels, 1])
        sliced = self.tensor(f"x{number}", pool.out_sizes, pool.dtype)
        self.ops.append(qnn_ops.strided_slice(self.name(f"x{number}_op"), canvas, sliced, ranges))
        return sliced


def _pool_max(b: _Builder, canvas, values) -> None:
    """PoolMax2d over the canvas, no padding, floor rounding: exactly ``out`` windows."""
    names = integration.get("OpPoolMax2d")
    op = b.op("values_op", "OpPoolMax2d", [canvas], [values])
    qnn_ops.uint32_param(op, names.param_filter_size, list(b.pool.kernel))
    qnn_ops.uint32_param(op, names.param_stride, list(b.pool.stride))
    qnn_ops.uint32_param(op, names.param_pad_amount, [[0, 0] for _ in b.pool.kernel])
    qnn_ops.uint32_scalar(op, names.param_rounding_mode, names.RoundingMode.FLOOR)


def _maximum_chain(b: _Builder, slices: list, values) -> None:
    running = slices[0]
    for number, sliced in enumerate(slices[1:], start=1):
        last = number == len(slices) - 1
        out = values if last else b.tensor(f"max{number}", b.pool.out_sizes, b.pool.dtype)
        b.op(f"max{number}_op", "OpElementWiseMaximum", [running, sliced], [out])
        running = out


def reads_padding(node: torch.fx.Node, pool: pg.MaxPoolBackward) -> bool:
    """Whether the pool's windows read a Pad's output: its input is executorch's
    ``constant_pad_nd`` (RecomposePadMaxPool2d), or ``_Builder.canvas`` pads it
    (padding, or ceil_mode's last windows)."""
    source = node.args[pg.F_INPUT]
    pad = integration.get("ops").edge.aten.constant_pad_nd.default
    explicit = isinstance(source, torch.fx.Node) and source.target == pad
    return explicit or any(pool.padding) or any(trailing_padding(pool))


def indices_used(node: torch.fx.Node) -> bool:
    """Whether anything reads the pool's indices (output 1), or the whole tuple."""
    return any(
        user.target is not operator.getitem or user.args[1] != pg.VALUES for user in node.users
    )


def _values(visitor, node: torch.fx.Node, nodes_to_wrappers, pool: pg.MaxPoolBackward):
    """The pool's values (output 0) built into a new ``_Builder``: PoolMax2d, or the
    ElementWiseMaximum chain where the windows read a Pad's output. Returns the builder,
    the window slices, the float values tensor and, for a quantized pool, the quantized
    output (else None)."""
    native = integration.get("Qnn_TensorType_t").QNN_TENSOR_TYPE_NATIVE
    source_node = visitor.get_node(node.args[pg.F_INPUT])
    source = visitor.define_tensor(
        source_node, node, visitor.get_tensor(source_node, node), native, nodes_to_wrappers
    )
    values = visitor.define_tensor(
        node, node, visitor.get_tensor(node, node, pg.VALUES), native, nodes_to_wrappers
    )
    b = _Builder(visitor, node, nodes_to_wrappers, pool)
    # A quantized pool (a pt2e model's) is built on its dequantized input, and its values
    # quantized again: the maximum is one of the inputs, so the round trip is exact, and
    # the -inf padding and the equalities are those of the float pool.
    quantized_values = None
    if source_node.meta.get(integration.get("QCOM_QUANT_ATTRS")):
        dequantized = b.tensor("dequantized", pool.in_sizes, torch.float32)
        b.op("dequantized_op", "OpDequantize", [source], [dequantized])
        source, quantized_values = dequantized, values
        values = b.tensor("values_float", pool.out_sizes, torch.float32)
    canvas = b.canvas(source)
    offsets = list(pool.offsets())
    slices = [b.window_slice(canvas, number, offset) for number, offset in enumerate(offsets)]
    if (
        VALUES == "pool_max"
        and all(d == 1 for d in pool.dilation)
        and not reads_padding(node, pool)
    ):
        _pool_max(b, canvas, values)
    elif len(slices) == 1:
        b.op("values_op", "OpReshape", [slices[0]], [values])
    else:
        _maximum_chain(b, slices, values)
    return b, slices, values, quantized_values


def _quantize_values(b: _Builder, values, quantized_values) -> None:
    if quantized_values is not None:
        b.op("values_quantized_op", "OpQuantize", [values], [quantized_values])


def build_values(visitor, node: torch.fx.Node, nodes_to_wrappers) -> list:
    """The values of a float pool whose indices are unused and that reads a Pad's
    output (``reads_padding``): the ElementWiseMaximum chain."""
    pool = pg.parse_forward(node)
    b, _, values, quantized_values = _values(visitor, node, nodes_to_wrappers, pool)
    _quantize_values(b, values, quantized_values)
    return b.ops


def build(visitor, node: torch.fx.Node, nodes_to_wrappers) -> list:
    """PoolMax2d values and int32 first-maximum indices (module docstring)."""
    pool = pg.parse_forward(node)
    b, slices, values, quantized_values = _values(visitor, node, nodes_to_wrappers, pool)
    native = integration.get("Qnn_TensorType_t").QNN_TENSOR_TYPE_NATIVE
    indices_value = visitor.get_tensor(node, node, pg.INDICES_OUTPUT).to(torch.int32)
    # executorch defines every output of a node with the node's quantization; the indices
    # of a quantized pool are int32 all the same.
    key = integration.get("QCOM_QUANT_ATTRS")
    attrs = node.meta.pop(key, None)
    try:
        indices = visitor.define_tensor(
            node, node, indices_value, native, nodes_to_wrappers, wrapper_idx=pg.INDICES_OUTPUT
        )
    finally:
        if attrs is not None:
            node.meta[key] = attrs
    offsets = list(pool.offsets())

    # torch's flat index counts in the pool's own (unpadded) input plane; window_table
    # marks padding -1, where the canvas holds -inf, which is never the maximum.
    plane = pg.IndexPlane(pool.in_sizes, (0,) * pg.SPATIAL_DIMS)

    def table(number: int):
        value = window_table(pool, plane, offsets[number])
        return qnn_ops.static_tensor(
            b.name(f"t{number}"), value, value.shape, torch.int32, nodes_to_wrappers
        )

    last = len(offsets) - 1
    running = table(last)
    # A 1x1 window still needs one Select: it broadcasts the table to [N, *out, C].
    for number in range(max(last - 1, 0), -1, -1):
        mask = b.tensor(f"eq{number}", pool.out_sizes, torch.bool)
        b.op(f"eq{number}_op", "OpElementWiseEqual", [slices[number], values], [mask])
        out = indices if number == 0 else b.tensor(f"idx{number}", pool.out_sizes, torch.int32)
        b.op(f"idx{number}_op", "OpElementWiseSelect", [mask, table(number), running], [out])
        running = out
    _quantize_values(b, values, quantized_values)
    return b.ops


def define_indices_cast(original, visitor, node: torch.fx.Node, nodes_to_wrappers):
    """An ``INDICES_CAST``: the forward's indices are int32 in QNN already, so a Reshape
    to the same shape (executorch's Cast visitor would read them as int64)."""
    if not node.meta.get(INDICES_CAST):
        return original()
    native = integration.get("Qnn_TensorType_t").QNN_TENSOR_TYPE_NATIVE
    source_node = visitor.get_node(node.args[0])
    value = visitor.get_tensor(source_node, node).to(torch.int32)
    source = visitor.define_tensor(source_node, node, value, native, nodes_to_wrappers)
    result = visitor.define_tensor(
        node, node, visitor.get_tensor(node, node), native, nodes_to_wrappers
    )
    return qnn_ops.reshape(f"{node.name}_identity", source, result)


def define_max_pool(original, visitor, node: torch.fx.Node, nodes_to_wrappers):
    """The plugin's pool with indices where it delegates the node's indices; else the
    values alone, as the Maximum chain, where a float pool reads a Pad's output
    (``reads_padding``); else executorch's visitor (PoolMax2d)."""
    if node.meta.get(INDICES_ON_HTP):
        return build(visitor, node, nodes_to_wrappers)
    quantized = node.args[pg.F_INPUT].meta.get(integration.get("QCOM_QUANT_ATTRS"))
    if not quantized and not indices_used(node) and reads_padding(node, pg.parse_forward(node)):
        return build_values(visitor, node, nodes_to_wrappers)
    # executorch's visitor refuses a pool whose indices are used (it stays on CPU).
    return original()
