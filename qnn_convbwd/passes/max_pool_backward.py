"""``max_pool2d_with_indices_backward`` made ready for QNN, or made right on CPU.

A node the support rules (``partition.max_pool``) delegate gets, before
partitioning:

* its indices cast to int32 by a ``_to_dim_order_copy``: QNN has no int64. When
  its forward pool may go to the HTP with its indices (``partition.max_pool.
  decide_forward``: every user of the indices is a delegated backward), the forward
  is marked ``INDICES_ON_HTP`` and the cast ``INDICES_CAST``: the partitioner
  delegates both or neither (the forward's plugin visitor makes the indices int32,
  the cast is then an identity). Otherwise the cast stays on CPU (``ON_CPU``), with
  the forward (executorch's max pool visitor refuses a pool whose indices are used);
* its input, read only for its shape, replaced by a static-shape ``full``
  (``SHAPE_OF``, see ``shape_only_operands.py``);
* ``INDEX_PLANE``: the plane its indices count in (``geometry.pool.index_plane``).

A node that stays on CPU is rewritten into portable kernels that compute it
right, when executorch's kernel would not::

    grad_input = view(index_put(full(0), [indices + plane starts], grad_output, True))[crop]

(``index_put`` with ``accumulate=True`` on the flattened planes). Two defects
of executorch 1.5.1 make that necessary:

* its portable ``max_pool2d_with_indices_backward.grad_input`` does not zero
  grad_input before adding into it (pytorch/executorch#21686, fixed by PR
  #21878): it adds to whatever the memory planner left in the buffer, e.g. the
  previous step's gradient. ``kernel_zeroes_grad_input()`` probes the installed
  kernel (a two-element program run twice); the rewrite is skipped for this
  reason on a kernel that zeroes.
* its RecomposePadMaxPool2d gives a padded forward pool explicit -inf padding,
  so the indices count in the padded plane while the backward node reads them
  as positions of the unpadded input. This is corrected whatever the kernel.

``MaxPoolBackwardOnCpu`` applies the CPU rewrite to any edge program, e.g. a
CPU-only one: ``to_edge(program).transform([MaxPoolBackwardOnCpu()])``.
"""

from __future__ import annotations

import functools
import logging
import operator
from collections.abc import Callable

import torch
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from .. import integration, nodes
from ..geometry import pool as pg
from ..meta import INDEX_PLANE, INDICES_CAST, INDICES_ON_HTP, ON_CPU, SHAPE_OF
from ..partition import max_pool
from ..partition.target import Target
from ..partition.verdict import Decision

logger = logging.getLogger(__name__)


def _int32_copy():
    """The dtype cast executorch's dim-order mode (the default of ``to_edge``) accepts."""
    return integration.get("ops").edge.dim_order_ops._to_dim_order_copy.default


@functools.lru_cache(maxsize=1)
def kernel_zeroes_grad_input() -> bool:
    """Whether executorch's portable max_pool2d_with_indices_backward zeroes grad_input.

    A real probe: a program made of the op alone (plain ``to_edge``, no
    delegate) runs twice on executorch's runtime with the same inputs. A kernel
    that adds into its output without zeroing it returns twice the gradient the
    second time, because the planned output buffer still holds the first result.
    A probe that cannot run counts as "does not zero" (the rewrite is right anyway).
    """
    try:
        return _probe()
    except Exception as err:  # no runtime here: the rewrite is right with any kernel
        logger.debug("max_pool2d_with_indices_backward kernel probe failed (%s)", err)
        return False


def _probe() -> bool:
    from executorch.exir import to_edge
    from executorch.runtime import Runtime

    class Probe(torch.nn.Module):
        def forward(self, grad, x, indices):
            return torch.ops.aten.max_pool2d_with_indices_backward(
                grad, x, [1, 2], [1, 2], [0, 0], [1, 1], False, indices
            )

    x = torch.tensor([[[[1.0, 2.0]]]])
    inputs = (torch.ones(1, 1, 1, 1), x, torch.tensor([[[[1]]]]))
    pte = to_edge(torch.export.export(Probe(), inputs)).to_executorch().buffer
    method = Runtime.get().load_program(pte).load_method("forward")
    first = method.execute(list(inputs))[0].clone()
    second = method.execute(list(inputs))[0].clone()
    zeroes = torch.equal(first, second) and torch.equal(first, torch.tensor([[[[0.0, 1.0]]]]))
    logger.debug("executorch's max_pool2d_with_indices_backward zeroes grad_input: %s", zeroes)
    return zeroes


def _fake_mode(node: torch.fx.Node):
    return integration.get("detect_fake_mode")([node.meta["val"]])


def _call(graph, op, args, kwargs, name, fake_mode, on_cpu: str | None):
    node = graph.create_node("call_function", op, tuple(args), kwargs, name=name)

    values = torch.fx.node.map_arg(tuple(args), lambda a: a.meta["val"])
    with fake_mode:
        node.meta["val"] = op(*values, **kwargs)
    if on_cpu is not None:
        node.meta[ON_CPU] = on_cpu
    return node


def needs_cpu_rewrite(node: torch.fx.Node) -> bool:
    """Whether executorch's CPU kernel would compute ``node`` wrong."""
    pool = pg.parse(node)
    return (
        not pg.index_plane(node, pool, nodes.edge_aten()).is_input or not kernel_zeroes_grad_input()
    )


def rewrite_for_cpu(graph_module: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    """Replace ``node`` by an accumulating ``index_put`` into zeros (portable kernels).

    ``index_put`` rather than ``scatter_add``: QnnPartitioner asks for
    ``scatter_add`` to be kept undecomposed and then refuses a program where one
    stays on CPU ("was not decomposed or delegated"). The flat indices of each
    (n, c) plane become positions in all planes by adding ``(n * C + c) * P``
    (an int32 ``arange``; int32 so that executorch's I64toI32 leaves it alone).
    """
    ops, graph = nodes.edge_aten(), graph_module.graph
    pool = pg.parse(node)
    plane = pg.index_plane(node, pool, ops)
    batch, channels = (int(v) for v in pool.input_shape[:2])
    out_size, plane_size = 1, 1
    for o in pool.out_sizes:
        out_size *= o
    for p in plane.sizes:
        plane_size *= p
    planes = batch * channels
    mode = _fake_mode(node)
    name = node.name

    def call(op, args, kwargs=None, suffix=""):
        return _call(graph, op, args, kwargs or {}, f"{name}_{suffix}", mode, name)

    with graph.inserting_before(node):
        indices = call(
            ops.view_copy.default,
            (node.args[pg.INDICES], [batch, channels, out_size]),
            suffix="indices",
        )
        indices = call(_int32_copy(), (indices,), {"dtype": torch.int32}, "indices_int32")
        starts = call(
            ops.arange.start_step,
            (0, planes * plane_size, plane_size),
            {"dtype": torch.int32},
            suffix="plane_starts",
        )
        starts = call(ops.view_copy.default, (starts, [batch, channels, 1]), suffix="starts")
        positions = call(ops.add.Tensor, (indices, starts), suffix="positions")
        positions = call(
            ops.view_copy.default, (positions, [planes * out_size]), suffix="flat_positions"
        )
        grad = call(
            ops.view_copy.default,
            (node.args[pg.GRAD_OUTPUT], [planes * out_size]),
            suffix="grad",
        )
        zeros = call(ops.full.default, ([planes * plane_size], 0.0), {"dtype": pool.dtype}, "zeros")
        result = call(ops.index_put.default, (zeros, [positions], grad, True), suffix="sum")
        result = call(
            ops.view_copy.default, (result, [batch, channels, *plane.sizes]), suffix="planes"
        )
        for dim, (offset, size) in enumerate(zip(plane.offset, pool.in_sizes)):
            if offset or plane.sizes[dim] != size:
                result = call(
                    ops.slice_copy.Tensor,
                    (result, 2 + dim, offset, offset + size),
                    suffix=f"crop{dim}",
                )
    node.replace_all_uses_with(result)
    graph.erase_node(node)


def prepare_for_qnn(graph_module: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    """int32 indices on CPU, a shape-only input, the index plane in the node's meta."""
    ops, graph = nodes.edge_aten(), graph_module.graph
    pool = pg.parse(node)
    # Once: after this, the indices come from the cast, and the plane from the forward.
    node.meta.setdefault(INDEX_PLANE, pg.index_plane(node, pool, ops))
    mode = _fake_mode(node)
    indices = node.args[pg.INDICES]
    source = node.args[pg.INPUT]
    with graph.inserting_before(node):
        if indices.meta["val"].dtype != torch.int32:
            from_htp = indices_from_htp(node)
            cast = _call(
                graph,
                _int32_copy(),
                (indices,),
                {"dtype": torch.int32},
                f"{node.name}_indices_int32",
                mode,
                None if from_htp else node.name,
            )
            if from_htp:
                # Delegated with the forward (an identity there: its indices are int32
                # in QNN already), or on CPU when the partitioner keeps the forward there.
                cast.meta[INDICES_CAST] = True
            node.replace_input_with(indices, cast)
        if source.target != ops.full.default:
            full = _call(
                graph,
                ops.full.default,
                (list(source.meta["val"].shape), 0.0),
                {"dtype": source.meta["val"].dtype},
                f"{node.name}_input_shape",
                mode,
                None,
            )
            full.meta[SHAPE_OF] = node.name
            node.replace_input_with(source, full)


def indices_from_htp(node: torch.fx.Node) -> bool:
    """The backward ``node`` reads the indices of a forward pool marked ``INDICES_ON_HTP``
    (directly, or through its ``INDICES_CAST``)."""
    indices = node.args[pg.INDICES]
    if isinstance(indices, torch.fx.Node) and indices.meta.get(INDICES_CAST):
        indices = indices.args[0]
    return (
        isinstance(indices, torch.fx.Node)
        and indices.target == operator.getitem
        and nodes.is_max_pool_with_indices(indices.args[0])
        and bool(indices.args[0].meta.get(INDICES_ON_HTP))
    )


def _pool_backward_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [n for n in graph.nodes if nodes.is_max_pool_backward(n)]


def mark_forward_pools(
    graph_module: torch.fx.GraphModule,
    target: Target,
    verdict: Callable[[torch.fx.Node], Decision],
) -> int:
    """Mark ``INDICES_ON_HTP`` the forward pools whose indices go to the HTP; return how many.

    Only pools whose indices are used; the decision (``decide_forward``) is logged
    here, once. ``verdict``: the partitioner's verdict without executorch's check.
    """

    def backward_delegated(backward: torch.fx.Node) -> bool:
        return verdict(backward).supported

    marked = 0
    for node in graph_module.graph.nodes:
        if not nodes.is_max_pool_with_indices(node) or not max_pool.indices_users(node):
            continue
        node.meta.pop(INDICES_ON_HTP, None)
        decision = max_pool.decide_forward(node, target, backward_delegated)
        # The graph rules (skip options, ...) on the pool itself, before it is marked.
        if decision.supported and verdict(node).supported:
            node.meta[INDICES_ON_HTP] = True
            marked += 1
        else:
            node.meta.pop(INDICES_ON_HTP, None)
    return marked


def rewrite(
    graph_module: torch.fx.GraphModule,
    target: Target,
    verdict: Callable[[torch.fx.Node], Decision],
) -> int:
    """Prepare delegated nodes for QNN, make CPU nodes right; return how many changed.

    ``verdict(node)``: the partitioner's verdict (``partition.judge``), without
    executorch's check.
    """
    changed = mark_forward_pools(graph_module, target, verdict)
    for node in _pool_backward_nodes(graph_module.graph):
        found = verdict(node)
        if found.supported:
            prepare_for_qnn(graph_module, node)
            changed += 1
        elif found.rejection.rule != "parse" and needs_cpu_rewrite(node):
            logger.info(
                "%s %s: runs on CPU as scatter_add (executorch's kernel would be wrong)",
                max_pool.OP,
                node.name,
            )
            rewrite_for_cpu(graph_module, node)
            changed += 1
    if changed:
        graph_module.graph.eliminate_dead_code()
        graph_module.recompile()
    return changed


class MaxPoolBackwardOnCpu(PassBase):
    """Rewrite every max_pool2d_with_indices_backward that executorch's CPU kernel
    would compute wrong into portable kernels that compute it right.

    For programs that never see the plugin's QNN pass, e.g. CPU-only::

        edge = to_edge(joint_program).transform([MaxPoolBackwardOnCpu()])
    """

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        changed = 0
        for node in _pool_backward_nodes(graph_module.graph):
            try:
                wrong = needs_cpu_rewrite(node)
            except pg.PoolArgumentError as err:
                logger.warning("%s %s: left as it is: %s", max_pool.OP, node.name, err)
                continue
            if wrong:
                rewrite_for_cpu(graph_module, node)
                changed += 1
        if changed:
            graph_module.recompile()
        return PassResult(graph_module, changed > 0)
