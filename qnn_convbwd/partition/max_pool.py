"""Every "can this max pool go to QNN?" decision: the backward, and the forward's indices.

Rules are small functions ``(node, pool, target) -> Rejection | None``, run in
order; the first rejection is logged as one line::

    max_pool2d_with_indices_backward <node>: not delegated: <reason> (<values>)
    max_pool2d_with_indices <node>: not delegated: <reason> (<values>)

A backward that stays on CPU is made right there by ``passes/max_pool_backward.py``.

A forward ``max_pool2d_with_indices`` whose indices are used is refused by
executorch's visitor; ``decide_forward`` delegates it (the plugin's visitor
computes the indices, ``builders/op_max_pool_with_indices.py``) only when every
user of the indices is a backward that is delegated too: the int32 indices then
never leave the delegate. Otherwise the forward stays on CPU, as without the
plugin. A pool whose indices are unused is executorch's business alone. The
forward's rules (``FORWARD_RULES``: the backward's target rules, then
``indices_users_delegated``) are the registry's family ``max_pool2d_with_indices``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import operator
from collections.abc import Callable

import torch

from ..geometry import pool as pg
from ..meta import INDICES_CAST
from ..nodes import is_max_pool_backward, is_max_pool_with_indices  # noqa: F401 (callers' names)
from . import target as targets
from .target import FLOAT_DTYPES, Target
from .verdict import Decision, Rejection, rules
from .verdict import decide as run_rules

logger = logging.getLogger(__name__)

OP = "max_pool2d_with_indices_backward"
FORWARD_OP = "max_pool2d_with_indices"
# Window offsets become one Equal/Select/Pad/Add chain each: bound the graph size.
MAX_WINDOW = 49


def indices_users(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The users of a forward pool's indices (of its getitem 1 nodes)."""
    return [
        user
        for item in node.users
        if item.op == "call_function"
        and item.target == operator.getitem
        and item.args[1] == pg.INDICES_OUTPUT
        for user in item.users
    ]


@dataclasses.dataclass(frozen=True)
class Asked:
    """What the forward's rules know of other nodes' verdicts: ``backward`` on a backward
    reading the indices, ``delegated`` (the partitioner's, or None) on any node."""

    backward: Callable[[torch.fx.Node], bool]
    delegated: Callable[[torch.fx.Node], bool] | None = None


Rule = Callable[[torch.fx.Node, pg.MaxPoolBackward, Target], Rejection | None]
RULES, rule = rules(OP)
# The forward pool's indices: its own family in the registry, run by ``decide_forward``.
FORWARD_RULES, forward_rule = rules(FORWARD_OP)


def also_forward(fn: Rule) -> Rule:
    """Register the backward's target rule ``fn`` for the forward's indices as it stands:
    the indices are only delegated with a backward, which needs them."""

    @functools.wraps(fn)
    def on_forward(node, pool, target, asked):
        return fn(node, pool, target)

    forward_rule(on_forward)
    return fn


@rule
@also_forward
def backend_is_htp(node, pool, target):
    # The transform pass rewrites the node for CPU or gives it int32 indices, for good
    # (target.py's policy): an unknown target keeps it on CPU.
    return targets.backend_is_htp(target, settled_before_partitioning=True)


@rule
@also_forward
def htp_arch_supported(node, pool, target):
    # Measured with QAIRT 2.51 (docs/max_pool.md): V69 to V81 compile the window masks.
    return targets.htp_arch_supported(target, "the window masks' float Select")


@rule
@also_forward
def float_gradient(node, pool, target):
    if pool.dtype not in FLOAT_DTYPES:
        return Rejection("grad_output dtype is not float32 or float16", f"dtype={pool.dtype}")
    return None


@rule
@also_forward
def window_size(node, pool, target):
    if pg.window_elements(pool.kernel) > MAX_WINDOW:
        return Rejection(
            f"window of more than {MAX_WINDOW} elements (one op chain per element)",
            f"kernel_size={list(pool.kernel)}",
        )
    return None


pooled_size = pg.pooled_size  # torch's output size of one pooled dim


@rule
def windows_fit(node, pool, target):
    expected = [pooled_size(i, k, s, p, d, pool.ceil_mode) for i, _, k, s, p, d in pool.per_dim()]
    if expected != list(pool.out_sizes) or any(
        p > k // 2 for p, k in zip(pool.padding, pool.kernel)
    ):
        return Rejection(
            "grad_output size is not torch's pooled size of the input",
            f"input={list(pool.in_sizes)}, grad_output={list(pool.out_sizes)}, "
            f"expected={expected}, padding={list(pool.padding)}",
        )
    return None


def decide(node: torch.fx.Node, target: Target, log: bool = True) -> Decision:
    """The backward's ``RULES`` on ``node``; ``Decision.parsed`` is its ``pg.MaxPoolBackward``."""
    return run_rules(
        node, OP, RULES, target, logger=logger, parse=(pg.parse, pg.PoolArgumentError), log_it=log
    )


# --- the forward pool's indices ---------------------------------------------------------


def between(source: torch.fx.Node, sink: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes on some path from ``source`` to ``sink`` (both excluded), in graph order."""
    ancestors: set[torch.fx.Node] = set()
    stack = list(sink.all_input_nodes)
    while stack:
        current = stack.pop()
        if current not in ancestors:
            ancestors.add(current)
            stack.extend(current.all_input_nodes)
    found: set[torch.fx.Node] = set()
    stack = list(source.users)
    while stack:
        current = stack.pop()
        if current in ancestors and current not in found:
            found.add(current)
            stack.extend(current.users)
    return [n for n in sink.graph.nodes if n in found]


def _decided_with_forward(node: torch.fx.Node, forward: torch.fx.Node) -> bool:
    """The forward's getitems and the int32 cast of its indices follow the forward."""
    if node.op == "call_function" and node.target == operator.getitem:
        return node.args[0] is forward
    return bool(node.meta.get(INDICES_CAST))


@forward_rule
def indices_users_delegated(node, pool, target, asked):
    """Every user of the indices is a max pool backward reading them as its indices,
    delegated (``asked.backward``): int32 indices must not reach a CPU op.

    With ``asked.delegated`` (the partitioner's verdict on any node), also every op on
    a path from the pool to its backward: one on CPU would put the two in different
    delegates, and the indices would cross between them as int64 tensors.
    """
    users = indices_users(node)
    if users and all(u.meta.get(INDICES_CAST) for u in users):
        users = [b for cast in users for b in cast.users]
    if not users:
        return Rejection("indices unused")
    for user in users:
        if not is_max_pool_backward(user) or user.args[pg.INDICES] is user.args[pg.INPUT]:
            kind = getattr(user.target, "__name__", str(user.target))
            return Rejection(
                "indices read by an op other than its backward", f"{user.name}: {kind}"
            )
        if not asked.backward(user):
            return Rejection(
                "indices read by a backward that stays on CPU", f"backward={user.name}"
            )
    if asked.delegated is None:
        return None
    for user in users:
        for other in between(node, user):
            if other.op == "call_function" and not _decided_with_forward(other, node):
                if not asked.delegated(other):
                    kind = getattr(other.target, "__name__", str(other.target))
                    return Rejection(
                        "an op on CPU between the pool and its backward would put them in "
                        "different delegates",
                        f"{other.name}: {kind}, backward={user.name}",
                    )
    return None


def decide_forward(
    node: torch.fx.Node,
    target: Target,
    backward_delegated: Callable[[torch.fx.Node], bool],
    delegated: Callable[[torch.fx.Node], bool] | None = None,
    log: bool = True,
) -> Decision:
    """Whether the plugin delegates the forward pool ``node`` with its indices: the
    ``FORWARD_RULES`` in order (``Asked`` for the two callables)."""
    asked = Asked(backward_delegated, delegated)
    return run_rules(
        node,
        FORWARD_OP,
        FORWARD_RULES,
        target,
        asked,
        logger=logger,
        parse=(pg.parse_forward, pg.PoolArgumentError),
        log_it=log,
    )
