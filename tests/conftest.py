"""Shared fixtures and the test tiers.

``htp``: needs the real QNN compiler, simulator or Saver. Every test using the
``qnn_sdk`` fixture (directly or through another fixture) gets the mark here;
tests that reach the toolchain otherwise carry it explicitly.
``slow``: long runs, skipped unless ``--slow`` is given.
``python -m pytest -m "not htp"`` is the quick tier (no QNN compile).
"""

from __future__ import annotations

import functools

import pytest


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="run the long property runs")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "qnn_sdk" in getattr(item, "fixturenames", ()) and "htp" not in item.keywords:
            item.add_marker(pytest.mark.htp)
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="long run: select with --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@functools.lru_cache(maxsize=1)
def _sdk_status() -> tuple[bool, str]:
    from qnn_convbwd.toolchain import SdkUnavailable, ensure_sdk

    try:
        info = ensure_sdk()
    except SdkUnavailable as err:
        return False, f"no usable QNN SDK: {err}"
    return True, f"QAIRT {info.build_id} at {info.root}"


@pytest.fixture(scope="session")
def qnn_sdk():
    """The active SdkInfo; skips with the reason when no SDK can be assembled."""
    ok, reason = _sdk_status()
    if not ok:
        pytest.skip(reason)
    from qnn_convbwd.toolchain import active_sdk

    return active_sdk()


@pytest.fixture
def plugin():
    """qnn_convbwd enabled for one test, disabled afterwards."""
    import qnn_convbwd

    with qnn_convbwd.enabled():
        yield qnn_convbwd
