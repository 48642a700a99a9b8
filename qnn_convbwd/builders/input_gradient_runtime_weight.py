"""The ``runtime_weight`` formulation: the shared convolution weight stored once.

Why ``transpose_conv`` stores the weight twice: the HTP compiler keeps, for every
op that reads a static tensor, a copy of that tensor prepared for the op. The
forward Conv2d reads the static HWIO weight; the backward TransposeConv2d reads
``Transpose(HWIO)``, which the compiler folds into a second static tensor. The
context binary then holds two prepared copies (measured: 128x128x3x3 fp16 adds
290,816 bytes to a 294,912-byte weight). Reading the same static HWIO tensor
from a second op of any other type (TransposeConv2d, MatMul with
``transpose_in1``, an element-wise op) adds a copy as well; only identical
Conv2d ops share one.

What this formulation does instead: before the forward Conv2d is built (through
``FORWARD_PRELUDES``, called by the plugin's wrapper of executorch's convolution
visitor), the weight becomes a *runtime* tensor. The flat HWIO weight is stored
as two static tensors, ``[1, n - t]`` (the head) and ``[1, t]`` (the tail, its
last ``t = RUNTIME_TAIL`` elements), each element once::

    tail (static [1, t]) x one (1.0 computed at run time from the forward input)
    Concat(head (static [1, n - t]), that) -> [1, n] -> Reshape -> HWIO
    HWIO (native) -> forward Conv2d                (dynamic filter)
    HWIO (native) -> Transpose -> HWOI -> TransposeConv2d   (transpose_conv, unchanged)

The multiplication by a value the compiler cannot know is what keeps it from
folding the chain back into static tensors (without it, Reshape is folded and
both ops get their own prepared copy again; so is a Concat of the whole weight
with a run-time value that a slice then drops). ``one`` is built so that it is
1.0 for every input value, NaN and infinities included: ``Equal(v, v) or
NotEqual(v, v)``, cast to float; ``w * 1.0`` is exact in every precision.

Why only the tail is multiplied (measured with QAIRT 2.51 on the x86-64
simulator, SM8650; docs/cost.md, "The runtime_weight prelude"): the HTP runs an
element-wise op in its tiled activation layout, so multiplying the whole weight
meant the multiply, a conversion of its result from that layout to the flat one
a dynamic filter is packed from, and a static stored in that layout (padded
unless shaped ``[1, H, 8, 32]``). For a 256x256x3x3 weight that took 100-660 M
simulator cycles in every shape tried, and 80-85 % of a resnet18 training step.
The flat Concat of the head takes 18-30 k cycles, and the flat statics it reads
are stored unpadded.

The cost moves to run time: the forward Conv2d and the backward TransposeConv2d
take a dynamic filter that the HTP prepares on every execution, plus a copy of
the weight and a reshape.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .. import integration, nodes
from ..geometry import conv as geo
from ..nodes import is_conv_bwd as _is_conv_bwd
from ..partition import judge
from . import qnn_ops, runtime_tensors, transpose_conv

logger = logging.getLogger(__name__)

NAME = "runtime_weight"

# Elements of the flat weight multiplied by the run-time 1.0 (the rest is only copied).
RUNTIME_TAIL = 64
# Rank of the stored tensors, ``[1, n]``, and of the ops that build the run-time weight.
FLAT_RANK = 2


def stored_layout(numel: int) -> tuple[int, int]:
    """``(head, tail)``: elements copied from the stored head, and computed in the tail.

    The tail is the last ``RUNTIME_TAIL`` elements of the flat weight (all of
    them for a smaller weight, which then has no head).
    """
    tail = min(RUNTIME_TAIL, numel)
    return numel - tail, tail


def _reads_weight_values(node: torch.fx.Node) -> bool:
    """A convolution_backward asking for grad_input (grad_weight needs only the shape)."""
    return _is_conv_bwd(node) and bool(node.args[geo.OUTPUT_MASK][0])


def _is_forward_conv(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target == nodes.edge_aten().convolution.default


def not_applicable(visitor, weight_node: torch.fx.Node) -> str | None:
    """Why ``weight_node`` keeps its static tensor in this graph (None: it becomes runtime).

    Every op reading the weight gets the wrapper cached under its name, so the
    runtime HWIO tensor is only made where all readers expect HWIO: non-transposed
    2-D and 3-D convolutions and convolution_backward, with at least one convolution and
    one convolution_backward that computes grad_input.
    """
    return nothing_to_share(visitor, weight_node) or kept_static(visitor, weight_node)


def nothing_to_share(visitor, weight_node: torch.fx.Node) -> str | None:
    """Why the formulation has nothing to do for ``weight_node`` (None: a frozen weight
    read by a convolution and by a grad_input convolution_backward)."""
    if not isinstance(weight_node, torch.fx.Node):
        return "weight is not a graph value"
    if runtime_tensors.reads_at_run_time(visitor, weight_node):
        return "read at run time already (a trainable parameter or a graph input)"
    if weight_node.meta.get(integration.get("QCOM_QUANT_ATTRS")):
        return "a quantized weight (grad_input reads its integers dequantized, weights.py)"
    users = list(weight_node.users)
    forward = [u for u in users if _is_forward_conv(u)]
    if not forward or not any(_reads_weight_values(u) for u in users):
        return "not read by both a convolution and a grad_input convolution_backward here"
    return None


def kept_static(visitor, weight_node: torch.fx.Node) -> str | None:
    """Why a weight the formulation would share keeps a static tensor per reader instead
    (None: it becomes one runtime tensor)."""
    users = list(weight_node.users)
    forward = [u for u in users if _is_forward_conv(u)]
    others = [u.name for u in users if not (_is_forward_conv(u) or _is_conv_bwd(u))]
    if others:
        return f"also read by {others}"
    if any(u.args[geo.F_TRANSPOSED] for u in forward):
        return "read by a transposed convolution"
    for user in filter(_reads_weight_values, users):
        try:  # a dilated filter is built in the graph from the run-time weight
            own = geo.dense_filter_reason(geo.parse(user))
        except geo.ConvArgumentError as err:
            own = f"{user.name}: {err}"
        if own is not None:
            return own
    if not integration.get("is_parameter")(weight_node, visitor.edge_program):
        return "weight is not a parameter of the program"
    weight = integration.get("get_parameter")(weight_node, visitor.edge_program)
    if weight.dim() not in (4, 5):
        return f"not a 2-D or 3-D convolution (weight rank {weight.dim()})"
    if not weight.dtype.is_floating_point:
        return f"weight dtype {weight.dtype}"
    quant_key = integration.get("QCOM_QUANT_ATTRS")
    if any(n.meta.get(quant_key) for n in [weight_node, *users]):
        return "quantized convolution"
    return None


def _runtime_one(visitor, sample_node, build_node, prefix: str, dtype, nodes_to_wrappers):
    """Ops computing a ``[1, 1]`` tensor of ones from ``sample_node``'s first element.

    The ones have the stored tensors' rank (``FLAT_RANK``) whatever the sample's:
    the HTP's element-wise ops reject rank 5 (measured: ElementWiseOr fails op
    validation with "incorrect Rank 5"), so the sample is reshaped first.
    """
    sample_value = visitor.get_tensor(sample_node, build_node)
    source = visitor.define_tensor(
        sample_node,
        build_node,
        sample_value,
        qnn_ops.adaptor_enum("Qnn_TensorType_t").QNN_TENSOR_TYPE_NATIVE,
        nodes_to_wrappers,
    )
    rank = sample_value.dim()
    unit = [1] * FLAT_RANK

    def tensor(name: str, tensor_dtype: torch.dtype, shape=unit):
        return qnn_ops.native_tensor(
            visitor, f"{prefix}_{name}", shape, tensor_dtype, nodes_to_wrappers
        )

    value, same, differs, either, one = (
        tensor("sample", sample_value.dtype, [1] * rank),
        tensor("same", torch.bool),
        tensor("differs", torch.bool),
        tensor("either", torch.bool),
        tensor("one", dtype),
    )
    head = [qnn_ops.strided_slice(f"{prefix}_sample", source, value, [[0, 1, 1]] * rank)]
    if rank != len(unit):
        flat = tensor("sample_flat", sample_value.dtype)
        head.append(qnn_ops.reshape(f"{prefix}_sample_flat", value, flat))
        value = flat
    ops = [
        *head,
        qnn_ops.new_op(
            f"{prefix}_same", integration.get("OpElementWiseEqual").op_name, [value, value], [same]
        ),
        qnn_ops.new_op(
            f"{prefix}_differs",
            integration.get("OpElementWiseNotEqual").op_name,
            [value, value],
            [differs],
        ),
        qnn_ops.new_op(
            f"{prefix}_either",
            integration.get("OpElementWiseOr").op_name,
            [same, differs],
            [either],
        ),
        qnn_ops.new_op(f"{prefix}_one", integration.get("OpCast").op_name, [either], [one]),
    ]
    return ops, one


def provide_runtime_weight(
    visitor,
    weight_node: torch.fx.Node,
    build_node: torch.fx.Node,
    sample_node: torch.fx.Node,
    nodes_to_wrappers,
) -> list:
    """Define the weight as a runtime HWIO tensor; return the ops that compute it.

    The HWIO wrapper is cached under the weight node's name, where executorch's
    Conv2d visitor and ``weights.static_weight_hwio`` look it up, so the forward
    Conv2d and the backward Transpose both read it. ``sample_node`` (an input of
    ``build_node``, available when it runs) supplies the run-time 1.0. Returns
    no ops when the weight keeps its static tensor (the reason is logged at
    DEBUG) or is defined already.
    """
    if nodes_to_wrappers[weight_node.name].get(0) is not None:
        return []  # runtime already (another reader came first), or static
    reason = nothing_to_share(visitor, weight_node)
    if reason is not None:
        logger.debug("%s: static weight kept: %s", weight_node.name, reason)
        return []
    reason = kept_static(visitor, weight_node)
    if reason is not None:
        reader = next((u for u in weight_node.users if _is_conv_bwd(u)), build_node)
        judge.record_fallback(
            reader,
            f"{NAME}: weight {weight_node.name} stored once, read at run time",
            "a static weight per reader",
            reason,
        )
        return []

    weight = integration.get("get_parameter")(weight_node, visitor.edge_program)
    hwio = weight.permute(geo.oihw_to_hwio(weight.dim() - 2)).contiguous()
    flat = hwio.reshape(1, -1)
    head, tail = stored_layout(hwio.numel())
    prefix = runtime_tensors.prelude_prefix(weight_node)

    def native(name: str, shape):
        return qnn_ops.native_tensor(
            visitor, f"{prefix}_{name}", shape, hwio.dtype, nodes_to_wrappers
        )

    ops, one = _runtime_one(visitor, sample_node, build_node, prefix, hwio.dtype, nodes_to_wrappers)
    # The tail: its own static tensor (numpy data; none while the partitioner
    # validates ops on fake parameters), times the run-time 1.0.
    tail_value = None if isinstance(weight, FakeTensor) else flat[:, head:].detach().numpy()
    tail_stored = qnn_ops.static_tensor(
        f"{prefix}_tail", tail_value, [1, tail], hwio.dtype, nodes_to_wrappers
    )
    source = native(runtime_tensors.PRELUDE_OUTPUT, [1, tail])
    ops.append(
        qnn_ops.new_op(
            f"{prefix}_scale",
            integration.get("OpElementWiseMultiply").op_name,
            [tail_stored, one],
            [source],
        )
    )
    if head:
        stored = visitor.define_tensor(
            weight_node,
            build_node,
            flat[:, :head],
            qnn_ops.adaptor_enum("Qnn_TensorType_t").QNN_TENSOR_TYPE_STATIC,
            nodes_to_wrappers,
            node_name=f"{prefix}_stored",
        )
        joined = native("joined", [1, hwio.numel()])
        concat = integration.get("OpConcat")
        op = qnn_ops.new_op(f"{prefix}_join", concat.op_name, [stored, source], [joined])
        qnn_ops.uint32_scalar(op, concat.param_axis, FLAT_RANK - 1)
        ops.append(op)
        source = joined
    # Cached under the weight node's own name: the forward Conv2d visitor asks for it.
    runtime_hwio = qnn_ops.native_tensor(
        visitor, weight_node.name, list(hwio.shape), hwio.dtype, nodes_to_wrappers
    )
    ops.append(qnn_ops.reshape(f"{prefix}_hwio", source, runtime_hwio))
    logger.debug(
        "%s: weight %s stored once as [1, %d] + [1, %d], HWIO %s at run time",
        build_node.name,
        weight_node.name,
        head,
        tail,
        list(hwio.shape),
    )
    return ops


def forward_prelude(visitor, conv_node: torch.fx.Node, nodes_to_wrappers) -> list:
    """Before the forward Conv2d is built: its weight becomes runtime (1.0 from its input)."""
    weight_node = conv_node.args[geo.F_WEIGHT]
    if not isinstance(weight_node, torch.fx.Node):
        return []
    sample = visitor.get_node(conv_node.args[geo.F_INPUT])
    return provide_runtime_weight(visitor, weight_node, conv_node, sample, nodes_to_wrappers)


def build(req) -> list:
    """grad_input: ``transpose_conv`` on the runtime weight.

    Normally the forward Conv2d, earlier in the graph, has made the weight
    runtime already. Where the backward is built first, it does so itself with
    1.0 from grad_output, so the order of the two in the graph does not matter.
    """
    weight_node = req.visitor.get_node(req.node.args[geo.WEIGHT])
    sample = req.visitor.get_node(req.node.args[geo.GRAD_OUTPUT])
    ops = provide_runtime_weight(req.visitor, weight_node, req.node, sample, req.nodes_to_wrappers)
    return [*ops, *transpose_conv.build(req)]


# Formulation name -> what runs before executorch builds a forward convolution.
FORWARD_PRELUDES: dict[str, Callable[[object, torch.fx.Node, dict], list]] = {
    NAME: forward_prelude,
}
