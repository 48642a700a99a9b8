"""Which ops may read a trainable parameter inside a QNN delegate.

A trainable parameter is a delegate input read at run time
(``qnn_convbwd.signature``). executorch visitors that read their parameters'
values while building the graph (batch/layer/group/instance/RMS norm, PReLU,
embedding: they call ``get_parameter``) cannot take it: inside the delegate
they would fail, or bake the initial values. Such a node stays on CPU, where
the program's numbers are right, and is logged once with the reason. In the
plugin's own flow a layer norm with a trainable weight or bias never reaches this
rule: ``passes/layer_norm.py`` writes it as ops that read the parameters at run time.
"""

from __future__ import annotations

import logging

import torch

from .. import signature

logger = logging.getLogger(__name__)

# executorch visitors that read an operand's values with get_parameter.
_STATIC_PARAMETER_OPS = (
    "_native_batch_norm_legit_no_training",
    "native_layer_norm",
    "native_group_norm",
    "instance_norm",
    "rms_norm",
    "_prelu_kernel",
    "prelu",
    "embedding",
)


def refusal(node: torch.fx.Node, program) -> str | None:
    """Why ``node`` cannot read a trainable parameter inside a delegate (None: it can)."""
    if program is None or node.op != "call_function":
        return None
    trainable = [arg.name for arg in node.args if signature.is_trainable_parameter(arg, program)]
    if not trainable:
        return None
    # Edge ops are named "aten.<op>.<overload>", ATen overloads "<op>.<overload>".
    name = getattr(node.target, "__name__", str(node.target)).removeprefix("aten.").split(".")[0]
    if name in _STATIC_PARAMETER_OPS:
        return (
            f"executorch's {name} visitor takes {', '.join(trainable)} as a constant; "
            "trainable parameters are read at run time"
        )
    return None


def message(node: torch.fx.Node, reason: str) -> str:
    return f"{node.name}: not delegated: {reason}"
