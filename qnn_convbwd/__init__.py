"""qnn_convbwd: lower aten.convolution_backward to Qualcomm QNN through ExecuTorch 1.5.1."""

from .api import (
    LoweringResult,
    Report,
    ReportRow,
    SideEffects,
    decide,
    disable,
    enable,
    enabled,
    is_enabled,
    lower,
    side_effects,
)
from .passes.max_pool_backward import MaxPoolBackwardOnCpu

__version__ = "0.1.0"

__all__ = [
    "LoweringResult",
    "MaxPoolBackwardOnCpu",
    "Report",
    "ReportRow",
    "SideEffects",
    "decide",
    "disable",
    "enable",
    "enabled",
    "is_enabled",
    "lower",
    "side_effects",
]
