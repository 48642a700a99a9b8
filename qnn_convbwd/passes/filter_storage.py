"""A training program keeps its trainable convolution weights in the delegate's layout.

With ``weight_layout == "hwio"`` a trainable convolution weight enters the delegate
in the QNN filter layout ``[*k, I, O]`` and its gradient leaves in it
(``passes.weight_layout``). When the program stores the weight in torch's ``[O, I,
*k]``, two permutes run on CPU every step, one of the weight and one of its
gradient: on resnet18 these were nearly all of the host's time in a step
(docs/training.md). ``store`` rewrites the joint program instead, before the
optimizer is attached: for each trainable parameter read only as the weight of
non-transposed convolutions and convolution_backwards (4-D or 5-D)::

    p [O, I, *k] -> conv / convolution_backward(weight=p) -> getitem 1 -> gradient output

becomes::

    p [*k, I, O] -> permute to [O, I, *k] (one per reader) -> conv / convolution_backward
      -> getitem 1 -> permute to [*k, I, O] -> gradient output

with the parameter's value stored permuted. Both permutes carry
``meta.STORED_FILTER`` in ``node.meta["custom"]`` (which survives executorch's
decompositions); ``passes.weight_layout`` marks them as the views the visitors fold
into the convolutions, so inside the delegate nothing moves, and on CPU nothing is
left. An optimizer attached afterwards (``passes.optimizer``) keeps its state in
the same layout: every op of an update is elementwise.

The program's names stay the module's; what it stores for such a parameter is the
permutation ``perm`` of torch's tensor (``stored = p.permute(perm)``). The program
carries the map ``{name: perm}`` as a constant method (``METHOD``), so a session
loaded from the ``.pte`` alone shows every parameter, gradient and optimizer state
in torch's layout (``training.TrainingSession``, ``ProgramOptimizerSession``).
Every permute is exact: the steps give the same bits as with the weights stored in
torch's layout (tests/test_filter_storage.py).
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Mapping

import torch
from torch.export.graph_signature import InputKind, OutputKind

from .. import integration
from ..geometry import conv as geo
from ..meta import STORED_FILTER

logger = logging.getLogger(__name__)

aten = torch.ops.aten

# The constant method of a training program that returns its stored layouts (JSON).
METHOD = "qnn_convbwd_stored_layouts"

_CONV = aten.convolution.default
_CONV_BWD = aten.convolution_backward.default
_CONV_WEIGHT, _CONV_TRANSPOSED = 1, 6
_BWD_WEIGHT, _BWD_TRANSPOSED = 2, 7


def inverse(perm: tuple[int, ...]) -> tuple[int, ...]:
    """The permutation undoing ``perm``."""
    result = [0] * len(perm)
    for position, dim in enumerate(perm):
        result[dim] = position
    return tuple(result)


def _weight_uses(node: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The readers of ``node`` if every use is the weight operand of a non-transposed
    ATen convolution or convolution_backward, else None."""
    readers = []
    for user in node.users:
        if user.target == _CONV:
            weight, transposed = _CONV_WEIGHT, _CONV_TRANSPOSED
        elif user.target == _CONV_BWD:
            weight, transposed = _BWD_WEIGHT, _BWD_TRANSPOSED
        else:
            return None
        positions = [i for i, arg in enumerate(user.args) if arg is node]
        if positions != [weight] or user.args[transposed] or node in user.kwargs.values():
            return None
        readers.append(user)
    return readers or None


def _permute(graph: torch.fx.Graph, source: torch.fx.Node, perm, fake_mode, tag: dict):
    node = graph.call_function(aten.permute.default, (source, list(perm)))
    with fake_mode:
        node.meta["val"] = source.meta["val"].permute(perm)
    node.meta["custom"] = {**source.meta.get("custom", {}), STORED_FILTER: tag}
    return node


def store(
    program: torch.export.ExportedProgram,
) -> tuple[torch.export.ExportedProgram, dict[str, tuple[int, ...]]]:
    """A copy of the joint ``program`` storing every eligible trainable convolution
    weight in the filter layout; returns it and ``{parameter name: perm}``."""
    program = copy.deepcopy(program)
    graph = program.graph
    signature = program.graph_signature
    output = graph.output_node()
    results = list(output.args[0])
    gradient_at = {
        spec.target: index
        for index, spec in enumerate(signature.output_specs)
        if spec.kind == OutputKind.GRADIENT_TO_PARAMETER
    }
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    fake_mode = integration.get("detect_fake_mode")([n.meta["val"] for n in placeholders.values()])
    stored: dict[str, tuple[int, ...]] = {}
    for spec in signature.input_specs:
        if spec.kind != InputKind.PARAMETER or spec.target not in gradient_at:
            continue
        node = placeholders[spec.arg.name]
        value = program.state_dict.get(spec.target)
        gradient = results[gradient_at[spec.target]]
        readers = _weight_uses(node)
        if (
            value is None
            or value.dim() not in (4, 5)
            or readers is None
            or not isinstance(gradient, torch.fx.Node)
        ):
            continue
        perm = geo.oihw_to_hwio(value.dim() - 2)
        back = inverse(perm)
        with torch.no_grad():
            permuted = value.detach().permute(perm).contiguous()
        program.state_dict[spec.target] = torch.nn.Parameter(
            permuted, requires_grad=value.requires_grad
        )
        node.meta["val"] = fake_mode.from_tensor(
            program.state_dict[spec.target], static_shapes=True
        )
        for reader in readers:
            with graph.inserting_before(reader):
                view = _permute(graph, node, back, fake_mode, {"weight": spec.target})
            reader.replace_input_with(node, view)
        with graph.inserting_before(output):
            results[gradient_at[spec.target]] = _permute(
                graph, gradient, perm, fake_mode, {"gradient": spec.target}
            )
        stored[spec.target] = perm
    if stored:
        output.args = (tuple(results),)
        program.graph_module.recompile()
        logger.info(
            "filter storage: %d trainable convolution weights stored as [*k, I, O]", len(stored)
        )
    return program, stored


def encode(stored: Mapping[str, tuple[int, ...]]) -> str:
    """The constant method's value for ``stored``."""
    return json.dumps({name: list(perm) for name, perm in sorted(stored.items())})


def decode(text: str) -> dict[str, tuple[int, ...]]:
    """``encode``'s inverse; a malformed value raises ValueError naming the method."""
    try:
        value = json.loads(text)
        result = {str(name): tuple(int(d) for d in perm) for name, perm in value.items()}
    except (ValueError, TypeError, AttributeError) as err:
        raise ValueError(f"the program's {METHOD} method holds no layout map: {err}") from err
    for name, perm in result.items():
        if sorted(perm) != list(range(len(perm))):
            raise ValueError(f"the program's {METHOD} method: {name} has no permutation {perm}")
    return result


def torch_view(tensor: torch.Tensor, perm: tuple[int, ...] | None) -> torch.Tensor:
    """``tensor`` stored permuted by ``perm`` seen in torch's layout (a view: writing into
    it writes the stored tensor)."""
    return tensor if perm is None else tensor.permute(inverse(perm))
