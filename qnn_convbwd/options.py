"""Switches of the lowering, set through ``qnn_convbwd.enable(**options)``."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Options:
    # How TransposeConv2d's output padding is expressed: "auto", "parameter" or
    # "fold" (see builders.conv_geometry.plan_input_gradient). "auto" avoids the
    # parameter where the HTP computes it wrongly (depthwise; beyond full extent).
    output_padding: str = "auto"
    # How grad_input is built: a key of builders.input_gradient.FORMULATIONS.
    input_gradient: str = "transpose_conv"


current = Options()


def update(**overrides: object) -> Options:
    """Apply ``overrides`` to the current options; unknown names raise TypeError."""
    global current
    current = dataclasses.replace(current, **overrides)
    return current
