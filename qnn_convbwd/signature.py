"""What a joint program's signature says about its parameters.

A joint forward-backward program (``torch.export.experimental._export_forward_backward``)
returns one ``GRADIENT_TO_PARAMETER`` output per trainable parameter. Those
parameters must stay top-level tensors of the lowered program: ExecuTorch's
training runtime hands them to the optimizer, which updates them in place, and
the delegate must read them at run time (a static copy inside a QNN context
would never see an update). A program that applies its own optimizer
(``passes.optimizer``) returns no gradients: its trainable parameters are buffers
it updates, whose placeholders carry ``meta.TRAINED``; they are trainable in the
same sense. Everything else the program reads as a parameter, buffer or constant
is frozen and may be baked into the delegate.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.export.graph_signature import OutputKind

from .meta import TRAINED


def trained_in_program(node: object) -> str | None:
    """The name of the parameter ``node`` reads when it is the placeholder of one the
    program's own optimizer updates (``passes.optimizer``), else None."""
    if not isinstance(node, torch.fx.Node) or node.op != "placeholder":
        return None
    return node.meta.get("custom", {}).get(TRAINED)


def trainable_parameters(program: torch.export.ExportedProgram) -> set[str]:
    """Fully qualified names of the parameters the program returns a gradient for, or
    updates with its own optimizer."""
    names = {
        spec.target
        for spec in program.graph_signature.output_specs
        if spec.kind == OutputKind.GRADIENT_TO_PARAMETER and spec.target is not None
    }
    to_buffer = program.graph_signature.inputs_to_buffers
    for node in program.graph.find_nodes(op="placeholder"):
        if trained_in_program(node) and node.name in to_buffer:
            names.add(to_buffer[node.name])
    return names


def trainable_placeholders(
    program: torch.export.ExportedProgram, graph: torch.fx.Graph | None = None
) -> list[torch.fx.Node]:
    """Placeholders of the program's trainable parameters, in graph order.

    ``graph``: the graph a pass is rewriting, when it is not ``program.graph``
    itself (placeholders are matched by name, as the signature names them).
    """
    trainable = trainable_parameters(program)
    if not trainable:
        return []
    signature = program.graph_signature
    to_state = {**signature.inputs_to_parameters, **signature.inputs_to_buffers}
    return [
        node
        for node in (program.graph if graph is None else graph).nodes
        if node.op == "placeholder" and to_state.get(node.name) in trainable
    ]


def is_trainable_parameter(node: object, program: torch.export.ExportedProgram) -> bool:
    """``node`` is the placeholder of a parameter ``program`` returns a gradient for."""
    if not isinstance(node, torch.fx.Node) or node.op != "placeholder":
        return False
    if trained_in_program(node) is not None:
        return node.name in program.graph_signature.inputs_to_buffers
    fqn = program.graph_signature.inputs_to_parameters.get(node.name)
    return fqn is not None and fqn in trainable_parameters(program)


GRADIENTS_INDEX = "__et_training_gradients_index_"
PARAMETERS_INDEX = "__et_training_parameters_index_"
_MUTATIONS = (OutputKind.BUFFER_MUTATION, OutputKind.USER_INPUT_MUTATION)


def runtime_training_metadata(original, methods: dict) -> dict:
    """executorch's training metadata with indices into the outputs the runtime returns.

    executorch 1.5.1 numbers a joint method's gradient and parameter outputs by
    their position among all of the signature's outputs, buffer mutations
    included; the runtime returns only the others (a mutation is written back
    to its buffer). In a program that mutates a buffer (a batch norm's running
    statistics) ``TrainingModule`` would then read the wrong outputs as
    gradients and parameters. This shifts each index by the mutations before it.
    """
    metadata = original(methods)
    for name, program in methods.items() if isinstance(methods, dict) else ():
        kinds = [spec.kind for spec in program.graph_signature.output_specs]
        for prefix in (GRADIENTS_INDEX, PARAMETERS_INDEX):
            index = metadata.get(prefix + name)
            if isinstance(index, int):
                metadata[prefix + name] = index - sum(k in _MUTATIONS for k in kinds[:index])
    return metadata


def mutable_initial_value(original: Callable[[], Any], emitter: Any, spec: Any) -> Any:
    """executorch's EValue of ``spec``, whose initial value, when it is a mutable buffer
    emitted by name, is looked up among the mutable buffers' values.

    executorch 1.5.1's emitter stores the initial value of a memory-planned buffer the
    program mutates (``et_init_buffer``) in the mutable data segment, but when the
    buffer's name is emitted (``emit_mutable_buffer_names``, what the training sessions
    read buffers by) it looks the value's bytes up among the *constants* already
    stored, and uses a hit's index in the mutable segment: a trained batch-norm weight
    of ones, or a zero momentum buffer, then starts from another buffer's values
    whenever a constant holds the same bytes (a frozen batch norm's running variance or
    mean). Here that look-up reads the mutable buffers' own table, which the emitter
    fills as it stores them."""
    info = getattr(spec, "extra_tensor_info", None)
    named_mutable = (
        getattr(spec, "const", False)
        and spec.mem_id is not None
        and spec.mem_offset is not None
        and info is not None
        and getattr(info.location, "name", "") != "EXTERNAL"
    )
    if not named_mutable:
        return original()
    state = emitter.program_state
    constants = state.cached_spec_hash_values
    state.cached_spec_hash_values = state.cached_spec_mutable_hash_values
    try:
        return original()
    finally:
        state.cached_spec_hash_values = constants
