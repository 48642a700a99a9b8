"""A rule's rejection, shared by every op's support rules, in one log format::

<op> <node>: not delegated: <reason> (<values>)
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Rejection:
    rule: str  # the rule's function name; filled in by the rules' decide()
    reason: str
    values: str
    op: str = "convolution_backward"

    def message(self, node_name: str) -> str:
        return f"{self.op} {node_name}: not delegated: {self.reason} ({self.values})"
