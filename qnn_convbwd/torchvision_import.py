"""``import torchvision`` on the CPU torch 2.13.0 this project pins.

Only CUDA wheels of torchvision 0.28.0 (the release paired with torch 2.13.0)
are served, so ``scripts/setup.sh`` installs one with ``--no-deps``. Its C ops
(``torchvision._C``) do not load against the CPU torch, and ``import
torchvision`` then fails in ``torchvision/_meta_registrations.py``, which
registers fake kernels for ``torchvision::nms`` and ``torchvision::qnms``: with
no C library those operators have no schema ("operator torchvision::nms does
not exist"). ``import_torchvision`` defines the two schemas (no kernel) before
the import. The classification models use no torchvision C op; calling
``torchvision.ops.nms`` raises "no kernel" instead of computing.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from types import ModuleType

import torch

TORCHVISION = "0.28.0"
_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_library: torch.library.Library | None = None  # kept alive: the schemas live as long as it


class TorchvisionUnavailable(ImportError):
    """torchvision is missing or cannot be imported; the message says how to install it."""


def _has_op(name: str) -> bool:
    try:
        getattr(torch.ops.torchvision, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def _define_missing_schemas() -> list[str]:
    global _library
    missing = [name for name in _SCHEMAS if not _has_op(name)]
    if missing:
        if _library is None:
            _library = torch.library.Library("torchvision", "FRAGMENT")  # noqa: TOR901
        for name in missing:
            _library.define(_SCHEMAS[name])
    return missing


def import_torchvision() -> ModuleType:
    """``torchvision``, importable without its C ops; raises TorchvisionUnavailable."""
    if "torchvision" in sys.modules:
        return sys.modules["torchvision"]
    try:
        version = importlib.metadata.version("torchvision")
    except importlib.metadata.PackageNotFoundError:
        raise TorchvisionUnavailable(
            f"torchvision is not installed; run scripts/setup.sh or "
            f"`python -m pip install --no-deps torchvision=={TORCHVISION}`"
        ) from None
    _define_missing_schemas()
    try:
        return importlib.import_module("torchvision")
    except Exception as err:  # torchvision fails in many ways against a mismatched torch
        raise TorchvisionUnavailable(
            f"torchvision {version} does not import with torch {torch.__version__} "
            f"({type(err).__name__}: {err}); this project pins torchvision=={TORCHVISION}"
        ) from err
