"""qnn_convbwd: lower aten.convolution_backward to Qualcomm QNN through ExecuTorch 1.5.1.

The public names are imported on first use: ``import qnn_convbwd`` alone loads
neither torch nor executorch, so the CLI, the doctor and the stdlib-only modules
(``logs``, ``toolchain.sdk``) start without them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> the module defining it
_PUBLIC = {
    "LoweringResult": "api",
    "Report": "api",
    "ReportRow": "api",
    "SideEffects": "api",
    "compile_specs": "toolchain.harness",
    "decide": "api",
    "disable": "api",
    "enable": "api",
    "enabled": "api",
    "is_enabled": "api",
    "lower": "api",
    "side_effects": "api",
    "MaxPoolBackwardOnCpu": "passes.max_pool_backward",
}

__all__ = [
    "LoweringResult",
    "MaxPoolBackwardOnCpu",
    "Report",
    "ReportRow",
    "SideEffects",
    "compile_specs",
    "decide",
    "disable",
    "enable",
    "enabled",
    "is_enabled",
    "lower",
    "side_effects",
]

if TYPE_CHECKING:
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
    from .toolchain.harness import compile_specs


def __getattr__(name: str):
    """A public name from its module; a submodule (``qnn_convbwd.integration``) by name."""
    if name in _PUBLIC:
        value = getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
        globals()[name] = value
        return value
    if not name.startswith("_"):
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
