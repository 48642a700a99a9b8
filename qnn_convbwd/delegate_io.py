"""The delegate's outputs, as QNN will bind them, in the order its signature lists them.

The QNN delegate binds its outputs by position: the k-th output tensor of the
compiled graph (QNN lists them in the order the ops that produce them are
built) is written into the k-th output buffer ExecuTorch passes. executorch
checks only that the counts agree. If a pass reorders producers after
partitioning, each gradient lands in another output's buffer: wrong values,
and a larger tensor overruns a smaller buffer (measured: the heap was
corrupted). This check compares the two orders right after the QNN ops are
built and fails the lowering, naming the outputs, instead.

Where the orders differ, ``bind_outputs_in_order`` first tries to reorder the
QNN ops (a topological order in which the outputs are built in the
signature's order: ``outputs_in_order``); a delegate's op order does not
change its values. Only an order no schedule can give (an earlier output
computed from a later one, or one op's outputs listed the other way round)
still fails.
"""

from __future__ import annotations

import heapq
import logging
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)


class DelegateOutputOrderError(RuntimeError):
    """QNN would write the delegate's outputs into the wrong buffers."""


def _qnn_name(node: torch.fx.Node) -> str:
    if node.op == "call_function" and node.target == operator.getitem:
        return f"output_{node.args[0].name}@{node.args[1]}"
    return f"output_{node.name}@0"


def _expected(edge_program: torch.export.ExportedProgram) -> list[str]:
    outputs = edge_program.graph_module.graph.output_node().args[0]
    return [_qnn_name(n) for n in outputs if isinstance(n, torch.fx.Node)]


def check_output_order(edge_program: torch.export.ExportedProgram, qnn_order: list[str]) -> None:
    expected = _expected(edge_program)
    if set(expected) != set(qnn_order) or len(expected) != len(qnn_order):
        return  # other names (mutable buffers, constants): nothing to compare
    if expected != qnn_order:
        raise DelegateOutputOrderError(
            "the QNN graph builds the delegate's outputs in another order than its signature "
            "lists them, so they would be written into each other's buffers:\n"
            f"  signature: {expected}\n  QNN      : {qnn_order}"
        )


def outputs_in_order(
    ops: Sequence[tuple[Sequence[str], Sequence[str]]], expected: Sequence[str]
) -> list[int]:
    """A topological order of ``ops`` ((input names, output names) each, given in a
    topological order) that builds the ``expected`` outputs in that order if any
    order can: each ready op is taken by the earliest expected output that needs it
    (its own, or one computed from it), ties in the given order."""
    position = {name: k for k, name in enumerate(expected)}
    producer = {name: i for i, (_, outs) in enumerate(ops) for name in outs}
    needs = [
        {producer[n] for n in ins if n in producer and producer[n] != i}
        for i, (ins, _) in enumerate(ops)
    ]
    users: list[list[int]] = [[] for _ in ops]
    for i, deps in enumerate(needs):
        for d in deps:
            users[d].append(i)
    unset = len(expected)
    rank = [unset] * len(ops)
    for i in reversed(range(len(ops))):
        own = [position[n] for n in ops[i][1] if n in position]
        rank[i] = min([*own, *(rank[u] for u in users[i]), unset])
    waiting = [len(deps) for deps in needs]
    ready = [(rank[i], i) for i in range(len(ops)) if not waiting[i]]
    heapq.heapify(ready)
    order = []
    while ready:
        _, i = heapq.heappop(ready)
        order.append(i)
        for u in users[i]:
            waiting[u] -= 1
            if not waiting[u]:
                heapq.heappush(ready, (rank[u], u))
    return order


def bind_outputs_in_order(
    edge_program: torch.export.ExportedProgram,
    wrappers: list,
    output_names: Callable[[list], list[str]],
    tensor_names: Callable[[Any], tuple[list[str], list[str]]],
) -> list:
    """``wrappers`` (executorch's QNN op wrappers of one delegate) in an order that
    builds the outputs as the signature lists them; raises DelegateOutputOrderError
    when none does. ``output_names(wrappers)`` gives QNN's output order,
    ``tensor_names(wrapper)`` an op's (inputs, outputs)."""
    expected = _expected(edge_program)
    built = output_names(wrappers)
    if built == expected or set(expected) != set(built) or len(expected) != len(built):
        return wrappers
    order = outputs_in_order([tensor_names(w) for w in wrappers], expected)
    if len(order) == len(wrappers):
        reordered = [wrappers[i] for i in order]
        if output_names(reordered) == expected:
            logger.debug(
                "QNN ops reordered to build the delegate's %d outputs in order", len(expected)
            )
            return reordered
    check_output_order(edge_program, built)
    return wrappers
