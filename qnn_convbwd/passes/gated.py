"""The shell of an option-gated rewrite: a to_edge transform pass switched by ``options``.

executorch's QNN pass manager constructs each transform pass with the edge
program and calls it on the graph module (``integration`` adds the plugin's to
its list). A subclass says when it applies (``enabled``, from the current
``options.Options``) and does its rewrite (``rewrite``, returning how many
places changed; the rewrite recompiles the graph module itself, so it can also
be called on its own, as the tests do).
"""

from __future__ import annotations

import torch
from torch.fx.passes.infra.pass_base import PassBase, PassResult


class OptionGatedPass(PassBase):
    """Runs ``rewrite`` when ``enabled(options.current)``; modified when it changed anything."""

    def __init__(self, edge_program=None) -> None:
        super().__init__()
        self.edge_program = edge_program

    def enabled(self, options) -> bool:  # options: qnn_convbwd.options.Options
        raise NotImplementedError

    def rewrite(self, graph_module: torch.fx.GraphModule) -> int:
        raise NotImplementedError

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        from .. import options

        if not self.enabled(options.current):
            return PassResult(graph_module, False)
        return PassResult(graph_module, self.rewrite(graph_module) > 0)
