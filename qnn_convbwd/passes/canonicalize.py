"""The plugin's to_edge transform pass: convolution_backward ready for partitioning.

Rewrites, in this order:

0. ``consecutive_permutes.fold_consecutive_permutes``: permute pairs (a linear
   layer's weight gradient) folded where the outer one stands, so QNN lists
   the delegate's outputs in the order of its signature;
0. ``int64_constants.narrow_int64_scalar_tensors``: int64 scalar constants of
   the integer tails (cross-entropy targets) become int32 like the rest;
0. ``full_reductions``: int64 constants compared with integer tensors get an
   int32 spec, and sums over every dim name their dims (a loss tail QNN takes);
0. ``conv1d.unbake_trainable_weights``: forward 1-D convolutions read their
   trainable weight, not the frozen copy executorch's CanonicalizeConv made;
1. ``conv1d.lift_conv1d``: 1-D nodes become 2-D nodes with a unit height, those
   that go to QNN and those that stay on CPU (executorch's CPU kernel computes
   2-D nodes only);

and, only on nodes the support rules delegate (and that executorch's skip
options do not keep on CPU):

2. ``split_gradients.split_input_gradient``: grad_input is split from
   grad_weight / grad_bias;
3. ``shape_only_operands.replace_shape_only_operands``: operands read only for
   their shape become a static-shape ``full``;

and on every ``max_pool2d_with_indices_backward``:

4. ``max_pool_backward.rewrite``: delegated nodes get int32 indices and a
   shape-only input; nodes that stay on CPU are made right there.
"""

from __future__ import annotations

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
            or nodes.is_max_pool_with_indices(node)
        ):
            node.meta.setdefault(NAME_SEEN, node.name)


class CanonicalizeConvolutionBackward(PassBase):
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
        # The partitioner's verdict, without executorch's check (it needs the QNN backend).
        context = judge.Context(
            target, frozenset(self.skip_node_id_set), frozenset(self.skip_node_op_set)
        )

        def delegated(node: torch.fx.Node) -> bool:
            return judge.judge(node, context, log=False).supported

        changed = unbake_trainable_weights(graph_module, self.edge_program)
        changed += narrow_int64_scalar_tensors(graph_module)
        changed += narrow_int64_comparison_constants(graph_module, self.edge_program)
        changed += explicit_full_reductions(graph_module)
        changed += fold_consecutive_permutes(graph_module)
        changed += lift_conv1d(
            graph_module,
            self.edge_program,
            delegated,
            lambda node: support.decide(node, target, log=False),
        )
        changed += split_input_gradient(graph_module, delegated)
        changed += replace_shape_only_operands(graph_module, delegated)
        # Logged here: a max pool backward kept on CPU is rewritten away before partitioning.
        changed += max_pool_backward.rewrite(
            graph_module, target, lambda n: judge.judge(n, context)
        )
        return PassResult(graph_module, changed > 0)
