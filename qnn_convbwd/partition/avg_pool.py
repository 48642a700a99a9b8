"""Every "can this average pool backward go to QNN?" decision.

Rules are small functions ``(node, pool, target) -> Rejection | None`` on the
parsed ``geometry.pool.AvgPoolBackward``, run in order; the first rejection is
logged as one line::

    avg_pool2d_backward <node>: not delegated: <reason> (<values>)

executorch 1.5.1's runtime has no kernel for this op (no ``aten::avg_pool2d_backward``
among the operators its Python runtime registers): a program holding one on CPU
fails to load ("Missing operator"), and ``judge`` warns once about each such node.
Arguments the parser does not understand are the rejection ``parse``.
"""

from __future__ import annotations

import logging

import torch

from ..geometry import pool as pg
from . import target as targets
from .target import Target
from .verdict import Decision, Rejection, rules
from .verdict import decide as run_rules

logger = logging.getLogger(__name__)

OP = "avg_pool2d_backward"
# Each window offset is one Pad and one Add of the placement: bound the graph size
# (15 x 15; a global average pool of a 7 x 7 map is 49).
MAX_WINDOW = 225

RULES, rule = rules(OP)


@rule
def backend_is_htp(node, pool, target):
    # Nothing the transform pass does to a delegated node is wrong on CPU: an unknown
    # target waits for the partitioner.
    return targets.backend_is_htp(target, settled_before_partitioning=False)


@rule
def htp_arch_supported(node, pool, target):
    return targets.htp_arch_supported(target, "the plugin's backward ops")


@rule
def window_size(node, pool, target):
    if pg.window_elements(pool.kernel) > MAX_WINDOW:
        return Rejection(
            f"window of more than {MAX_WINDOW} elements (one Pad and Add per element)",
            f"kernel_size={list(pool.kernel)}",
        )
    return None


def decide(node: torch.fx.Node, target: Target, log: bool = True) -> Decision:
    """``RULES`` on ``node``; ``Decision.parsed`` is its ``pg.AvgPoolBackward``."""
    return run_rules(
        node,
        OP,
        RULES,
        target,
        logger=logger,
        parse=(pg.parse_avg, pg.PoolArgumentError),
        log_it=log,
    )
