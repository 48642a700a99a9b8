"""Formulations of grad_input on QNN, selected by ``Options.input_gradient``.

Each formulation builds the ops that turn grad_output into grad_input for one
convolution_backward node and returns them in execution order. They share the
signature of ``transpose_conv.build``; register new ones in FORMULATIONS.
"""

from __future__ import annotations

from collections.abc import Callable

from . import input_gradient_runtime_weight, transpose_conv
from .transpose_conv import GradInputRequest

FORMULATIONS: dict[str, Callable[[GradInputRequest], list]] = {
    "transpose_conv": transpose_conv.build,
    # transpose_conv on a runtime weight, stored once (see that module).
    input_gradient_runtime_weight.NAME: input_gradient_runtime_weight.build,
}
