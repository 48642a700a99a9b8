"""Which parametrized cases of a sweep run in the default tier, and which only with --slow.

A sweep repeats one check over SoCs or configurations. The default tier keeps
representative ones; the rest are marked ``slow`` with the reason the skip shows.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest

# A check whose code path does not depend on the SoC, repeated on another HTP arch.
ANOTHER_ARCH = "the same check on another HTP arch (SoC sweep)"


def sweep(default: Iterable, more: Iterable, reason: str = ANOTHER_ARCH) -> list:
    """``default`` in every tier, then ``more`` only with --slow (skipped saying ``reason``)."""
    slow = pytest.mark.slow(reason=reason)
    return [*default, *(pytest.param(value, marks=slow) for value in more)]
