"""A rule's rejection, and the one registry of every rule, shared by every op::

<op> <node>: not delegated: <reason> (<values>)

Rules are small named functions returning a ``Rejection`` (or None), registered
by family: ``convolution_backward`` (``support.py``),
``max_pool2d_with_indices_backward`` and the forward pool's indices,
``max_pool2d_with_indices`` (``max_pool.py``), and the rules on every node and
executorch's own reasons (``judge.py``). ``judge.judge`` runs them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Rejection:
    rule: str  # the rule's function name; filled in by the rules' decide()
    reason: str
    values: str
    op: str = "convolution_backward"

    def message(self, node_name: str) -> str:
        values = f" ({self.values})" if self.values else ""
        return f"{self.op} {node_name}: not delegated: {self.reason}{values}"


# family -> [(rule name, rule)], in the order the rules run.
REGISTRY: dict[str, list[tuple[str, Callable[..., Rejection | None]]]] = {}


def rules(family: str) -> tuple[list[tuple[str, Callable]], Callable[[Callable], Callable]]:
    """The family's rule list (registered in ``REGISTRY``) and its ``@rule`` decorator."""
    found = REGISTRY.setdefault(family, [])

    def rule(fn: Callable) -> Callable:
        found.append((fn.__name__, fn))
        return fn

    return found, rule


def registered() -> list[tuple[str, str]]:
    """Every (family, rule name) in the registry."""
    return [(family, name) for family, found in REGISTRY.items() for name, _ in found]
