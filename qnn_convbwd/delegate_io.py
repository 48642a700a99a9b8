"""The delegate's outputs, as QNN will bind them, in the order its signature lists them.

The QNN delegate binds its outputs by position: the k-th output tensor of the
compiled graph (QNN lists them in the order the ops that produce them are
built) is written into the k-th output buffer ExecuTorch passes. executorch
checks only that the counts agree. If a pass reorders producers after
partitioning, each gradient lands in another output's buffer: wrong values,
and a larger tensor overruns a smaller buffer (measured: the heap was
corrupted). This check compares the two orders right after the QNN ops are
built and fails the lowering, naming the outputs, instead.
"""

from __future__ import annotations

import operator

import torch


class DelegateOutputOrderError(RuntimeError):
    """QNN would write the delegate's outputs into the wrong buffers."""


def _qnn_name(node: torch.fx.Node) -> str:
    if node.op == "call_function" and node.target == operator.getitem:
        return f"output_{node.args[0].name}@{node.args[1]}"
    return f"output_{node.name}@0"


def check_output_order(edge_program: torch.export.ExportedProgram, qnn_order: list[str]) -> None:
    outputs = edge_program.graph_module.graph.output_node().args[0]
    expected = [_qnn_name(n) for n in outputs if isinstance(n, torch.fx.Node)]
    if set(expected) != set(qnn_order) or len(expected) != len(qnn_order):
        return  # other names (mutable buffers, constants): nothing to compare
    if expected != qnn_order:
        raise DelegateOutputOrderError(
            "the QNN graph builds the delegate's outputs in another order than its signature "
            "lists them, so they would be written into each other's buffers:\n"
            f"  signature: {expected}\n  QNN      : {qnn_order}"
        )
