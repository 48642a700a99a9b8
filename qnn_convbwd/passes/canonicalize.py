"""The plugin's last to_edge transform pass: convolution_backward ready for partitioning.

``CanonicalizeConvolutionBackward`` runs a sequence of small rewrites, each a
function ``(graph_module, Canonicalization) -> changed count`` defined here; their
order, and why each sits where it does, is declared in ``qnn_convbwd.pipeline``
(the ``canonicalize`` stages), which makes the pass with them (``running``). Some
rewrite only the nodes the support rules delegate (and that executorch's skip
options do not keep on CPU): ``Canonicalization.delegated`` is the partitioner's
verdict, computed without executorch's own check (which needs the QNN backend).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from .. import nodes
from ..meta import NAME_SEEN
from ..partition import judge, support
from ..partition.target import Target
from . import max_pool_backward
from .consecutive_permutes import fold_consecutive_permutes
from .conv1d import lift_conv1d, unbake_trainable_weights
from .full_reductions import explicit_full_reductions, narrow_int64_comparison_constants
from .int64_constants import narrow_int64_scalar_tensors
from .shape_only_operands import replace_shape_only_operands
from .split_gradients import split_input_gradient


def _remember_names(graph: torch.fx.Graph) -> None:
    for node in graph.nodes:
        if (
            nodes.is_conv_bwd(node)
            or nodes.is_max_pool_backward(node)
            or nodes.is_avg_pool_backward(node)
            or nodes.is_max_pool_with_indices(node)
        ):
            node.meta.setdefault(NAME_SEEN, node.name)


@dataclasses.dataclass(frozen=True)
class Canonicalization:
    """What the rewrites of one run of the pass read."""

    edge_program: Any
    target: Target
    context: judge.Context

    def delegated(self, node: torch.fx.Node) -> bool:
        return judge.judge(node, self.context, log=False).supported


# --- the rewrites, in the signature the pass calls them with ----------------------------


def unbake_conv1d_weights(graph_module: torch.fx.GraphModule, c: Canonicalization) -> int:
    return unbake_trainable_weights(graph_module, c.edge_program)


def narrow_int64_scalars(graph_module: torch.fx.GraphModule, c: Canonicalization) -> int:
    return narrow_int64_scalar_tensors(graph_module)


def narrow_int64_comparisons(graph_module: torch.fx.GraphModule, c: Canonicalization) -> int:
    return narrow_int64_comparison_constants(graph_module, c.edge_program)


def name_full_reductions(graph_module: torch.fx.GraphModule, c: Canonicalization) -> int:
    return explicit_full_reductions(graph_module)


def fold_permute_pairs(graph_module: torch.fx.GraphModule, c: Canonicalization) -> int:
    return fold_consecutive_permutes(graph_module)


def lift_conv1d_to_2d(graph_module: torch.fx.GraphModule, c: Canonicalization) -> int:
    return lift_conv1d(
        graph_module,
        c.edge_program,
        c.delegated,
        lambda node: support.decide(node, c.target, log=False),
    )


def split_grad_input(graph_module: torch.fx.GraphModule, c: Canonicalization) -> int:
    return split_input_gradient(graph_module, c.delegated)


def static_shape_operands(graph_module: torch.fx.GraphModule, c: Canonicalization) -> int:
    return replace_shape_only_operands(graph_module, c.delegated)


def max_pool_backwards(graph_module: torch.fx.GraphModule, c: Canonicalization) -> int:
    # Logged here: a max pool backward kept on CPU is rewritten away before partitioning.
    return max_pool_backward.rewrite(
        graph_module, c.target, lambda node: judge.judge(node, c.context)
    )


Step = Callable[[torch.fx.GraphModule, Canonicalization], int]


class CanonicalizeConvolutionBackward(PassBase):
    """Runs ``steps`` in order; ``running`` makes the pass with the pipeline's steps."""

    steps: tuple[Step, ...] = ()

    def __init__(
        self,
        edge_program=None,
        compiler_specs=None,
        skip_node_id_set=None,
        skip_node_op_set=None,
    ) -> None:
        super().__init__()
        self.edge_program = edge_program
        self.compiler_specs = compiler_specs
        # executorch's QnnPartitioner skip options (the pass manager hands them to
        # passes whose __init__ asks for them): nodes they keep on CPU stay as they are.
        self.skip_node_id_set = set(skip_node_id_set or ())
        self.skip_node_op_set = set(skip_node_op_set or ())

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        target = (
            Target.from_compile_specs(self.compiler_specs, self.edge_program)
            if self.compiler_specs
            else Target.unknown(self.edge_program)
        )
        _remember_names(graph_module.graph)
        context = judge.Context(
            target, frozenset(self.skip_node_id_set), frozenset(self.skip_node_op_set)
        )
        run = Canonicalization(self.edge_program, target, context)
        changed = sum(step(graph_module, run) for step in self.steps)
        return PassResult(graph_module, changed > 0)


def running(steps: tuple[Step, ...]) -> type[CanonicalizeConvolutionBackward]:
    """``CanonicalizeConvolutionBackward`` running ``steps``, in that order."""
    return type(
        CanonicalizeConvolutionBackward.__name__,
        (CanonicalizeConvolutionBackward,),
        {"steps": steps, "__module__": __name__},
    )
