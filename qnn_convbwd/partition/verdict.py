"""Rules, the one runner that applies them, and the decision it returns.

A rule is a small named function: given the node (and what its family passes
along: the parsed op and the target, or the judge's context) it returns None to
accept, or a ``Rejection`` with its reason and values. Rules are registered by
family, in the order they run, in ``REGISTRY``: ``convolution_backward``
(``support.py``), ``max_pool2d_with_indices_backward`` and the forward pool's
indices, ``max_pool2d_with_indices`` (``max_pool.py``), and the rules on every
node and executorch's own reasons (``judge.py``).

``decide`` runs one family's list on a node: the first rejection is the node's
decision, named after its rule and logged as one line::

    <op> <node>: not delegated: <reason> (<values>)

``judge.judge`` combines the families into the node's whole verdict with the same
pieces (``first_rejection``, ``log``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class Rejection:
    """Why a node is not delegated. Rules give ``reason`` and ``values``; the runner
    fills in ``rule`` (the rule's function name) and ``op``."""

    reason: str
    values: str = ""
    rule: str = ""
    op: str = ""

    def message(self, node_name: str) -> str:
        values = f" ({self.values})" if self.values else ""
        return f"{self.op} {node_name}: not delegated: {self.reason}{values}"


@dataclasses.dataclass(frozen=True)
class Decision:
    """Whether one node is delegated, and if not, which rule said so and why."""

    node: str
    op: str
    rejection: Rejection | None
    # The op's parsed arguments (``geometry.conv.ConvBackward``,
    # ``geometry.pool.MaxPoolBackward``), when its family parses it.
    parsed: Any = None

    @property
    def supported(self) -> bool:
        return self.rejection is None

    @property
    def reason(self) -> str:
        if self.rejection is None:
            return "delegated"
        rejection = self.rejection
        return f"{rejection.reason} ({rejection.values})" if rejection.values else rejection.reason


@dataclasses.dataclass(frozen=True)
class Fallback:
    """A delegated node a builder built another way than the options asked, and why:
    the node runs on the HTP, in the formulation ``built`` instead of ``asked``."""

    node: str
    op: str
    asked: str  # e.g. 'stride="phases"'
    built: str  # e.g. 'stride="zero_insert"'
    reason: str

    def message(self) -> str:
        return f"{self.op} {self.node}: {self.asked} falls back to {self.built}: {self.reason}"


Rule = Callable[..., Rejection | None]
RuleList = Sequence[tuple[str, Rule]]

# family -> [(rule name, rule)], in the order the rules run.
REGISTRY: dict[str, list[tuple[str, Rule]]] = {}


def rules(family: str) -> tuple[list[tuple[str, Rule]], Callable[[Rule], Rule]]:
    """The family's rule list (registered in ``REGISTRY``) and its ``@rule`` decorator."""
    found = REGISTRY.setdefault(family, [])

    def rule(fn: Rule) -> Rule:
        found.append((fn.__name__, fn))
        return fn

    return found, rule


def registered() -> list[tuple[str, str]]:
    """Every (family, rule name) in the registry."""
    return [(family, name) for family, found in REGISTRY.items() for name, _ in found]


def first_rejection(rule_list: RuleList, op: str, *args: Any) -> Rejection | None:
    """The first rule of ``rule_list`` (called as ``rule(*args)``) that rejects, named."""
    for name, fn in rule_list:
        found = fn(*args)
        if found is not None:
            return dataclasses.replace(found, rule=name, op=op)
    return None


def log(logger: logging.Logger, decision: Decision) -> None:
    """The decision's one INFO line, if it is a rejection."""
    if decision.rejection is None:
        return
    # ``extra`` lets callers (and tests) tell which rule spoke without parsing text.
    logger.info(
        decision.rejection.message(decision.node),
        extra={"convbwd_node": decision.node, "convbwd_rule": decision.rejection.rule},
    )


def decide(
    node: torch.fx.Node,
    op: str,
    rule_list: RuleList,
    *args: Any,
    logger: logging.Logger,
    parse: tuple[Callable[[torch.fx.Node], Any], type[Exception]] | None = None,
    log_it: bool = True,
) -> Decision:
    """Run ``rule_list`` on ``node``: each rule is called as ``rule(node, parsed, *args)``
    (``rule(node, *args)`` without ``parse``) until one rejects; log the rejection.

    ``parse``: the op's argument parser and the error it raises; arguments it does not
    understand are a rejection of the rule ``parse``.
    """
    parsed = None
    if parse is not None:
        parser, error = parse
        try:
            parsed = parser(node)
        except error as err:
            rejection = Rejection("arguments not understood", str(err), rule="parse", op=op)
            return settle(Decision(node.name, op, rejection), logger, log_it)
        args = (parsed, *args)
    rejection = first_rejection(rule_list, op, node, *args)
    return settle(Decision(node.name, op, rejection, parsed), logger, log_it)


def settle(decision: Decision, logger: logging.Logger, log_it: bool = True) -> Decision:
    """``decision``, logged when ``log_it``."""
    if log_it:
        log(logger, decision)
    return decision
