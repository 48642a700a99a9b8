"""Switches of the lowering, set through ``qnn_convbwd.enable(**options)``."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Options:
    # How TransposeConv's padding and output padding are expressed: "auto",
    # "parameter", "fold" or "crop" (see builders.conv_geometry.plan_input_gradient).
    # "auto" avoids the parameters where the HTP computes them wrongly (2-D:
    # depthwise, beyond full extent; 3-D: always "crop").
    output_padding: str = "auto"
    # How grad_input is built: a key of builders.input_gradient.FORMULATIONS.
    # "runtime_weight" stores a weight shared with a forward Conv2d once (the
    # filter of both ops is computed at run time); "transpose_conv" keeps static
    # filters and stores the weight twice (see README, "Weight stored once").
    input_gradient: str = "runtime_weight"


current = Options()


def update(**overrides: object) -> Options:
    """Apply ``overrides`` to the current options; unknown names raise TypeError."""
    global current
    current = dataclasses.replace(current, **overrides)
    return current
