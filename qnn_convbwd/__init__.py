"""qnn_convbwd: lower aten.convolution_backward to Qualcomm QNN through ExecuTorch 1.5.1."""

from .api import (
    LoweringResult,
    Report,
    ReportRow,
    decide,
    disable,
    enable,
    enabled,
    is_enabled,
    lower,
)

__version__ = "0.1.0"

__all__ = [
    "LoweringResult",
    "Report",
    "ReportRow",
    "decide",
    "disable",
    "enable",
    "enabled",
    "is_enabled",
    "lower",
]
