"""int64 constants that stay on CPU keep their int64 spec.

executorch's ``I64toI32`` pass narrows what QNN cannot take: an int64 constant
of the program (cross-entropy's ``ignore_index``, a ``one_hot`` class range, any
lifted int64 scalar) gets a 4-byte dtype in its ``meta["val"]``, while the
stored value stays int64. A constant that a delegate consumes is baked into the
QNN graph from the narrowed spec and all is well; one that stays a top-level
constant (its consumer runs on CPU) would be emitted with the narrowed spec and
the 8-byte value, and ``to_executorch()`` fails (``Tensor spec has buffer of
size 8, but expected nbytes of 4``). After partitioning, such a constant gets
its stored dtype back: the CPU kernels then read exactly the values the user's
program holds.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def _stored_value(program: torch.export.ExportedProgram, node: torch.fx.Node):
    signature = program.graph_signature
    if node.name in signature.inputs_to_lifted_tensor_constants:
        return program.constants.get(signature.inputs_to_lifted_tensor_constants[node.name])
    if node.name in signature.inputs_to_buffers:
        name = signature.inputs_to_buffers[node.name]
        return program.state_dict.get(name, program.constants.get(name))
    if node.name in signature.inputs_to_parameters:
        return program.state_dict.get(signature.inputs_to_parameters[node.name])
    return None


def restore_cpu_constant_dtypes(program: torch.export.ExportedProgram) -> list[str]:
    """Give untagged (top-level) constants the dtype of their stored value; return their names."""
    restored = []
    for node in program.graph.nodes:
        if node.op != "placeholder" or "delegation_tag" in node.meta:
            continue
        stored = _stored_value(program, node)
        value = node.meta.get("val")
        if not isinstance(stored, torch.Tensor) or not isinstance(value, torch.Tensor):
            continue
        if stored.dtype != value.dtype and stored.dtype == torch.int64:
            node.meta["val"] = value.to(stored.dtype)
            restored.append(node.name)
    if restored:
        logger.debug("int64 constants kept on CPU with their stored dtype: %s", restored)
    return restored


def narrow_int64_scalar_tensors(graph_module: torch.fx.GraphModule) -> int:
    """int64 ``aten.scalar_tensor`` nodes become int32, as ``I64toI32`` makes the rest.

    Joint graphs hold ``torch.ops.aten.scalar_tensor`` (not the edge op that
    ``I64toI32`` narrows) in the integer tails of cross-entropy: ``where(ne(target,
    ignore_index), target, 0)``. Left int64 next to targets narrowed to int32, the
    CPU kernel of ``where`` fails (``common_type == out.scalar_type()``). Values
    outside int32's range stay int64.
    """
    info = torch.iinfo(torch.int32)
    changed = 0
    for node in graph_module.graph.nodes:
        if node.op != "call_function" or node.target != torch.ops.aten.scalar_tensor.default:
            continue
        if node.kwargs.get("dtype") != torch.int64 or not node.args:
            continue
        value = node.args[0]
        if not isinstance(value, (int, bool)) or not info.min <= int(value) <= info.max:
            continue
        node.kwargs = {**node.kwargs, "dtype": torch.int32}
        if isinstance(node.meta.get("val"), torch.Tensor):
            node.meta["val"] = node.meta["val"].to(torch.int32)
        changed += 1
    if changed:
        graph_module.recompile()
    return changed
