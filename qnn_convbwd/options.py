"""Switches of the lowering, set through ``qnn_convbwd.enable(**options)``."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Options:
    # Express output_padding of depthwise TransposeConv2d through the end padding
    # (plus a zero Pad) instead of the output_padding parameter, which the HTP
    # simulator computes wrongly for depthwise convolutions (QAIRT 2.51).
    fold_depthwise_output_padding: bool = True
    # How grad_input is built: a key of builders.input_gradient.FORMULATIONS.
    input_gradient: str = "transpose_conv"


current = Options()


def update(**overrides: object) -> Options:
    """Apply ``overrides`` to the current options; unknown names raise TypeError."""
    global current
    current = dataclasses.replace(current, **overrides)
    return current
