"""How the suite's tests are shared out between pytest-xdist workers.

Each test module is one unit of work, run whole on one worker in file order, so its
module fixtures and cached graphs are built once; modules that read the same
session fixture or cached graph are one unit (``SHARED_GROUPS``). Units start
longest first. ``tests/conftest.py`` registers this module as a plugin.

The unit is derived from the test's node id by ``ModuleGroups``, a scheduler of our
own, not by ``--dist loadgroup``: loadgroup passes an ``xdist_group`` mark to the
controller by rewriting the item's node id, which pytest 9.2 no longer lets a
plugin do, so with pytest-xdist 3.8.0 it silently hands the tests out one by one
(pytest-dev/pytest-xdist#1386). ``tests/test_workers.py`` runs a small suite on two
workers to check the units hold.
"""

from __future__ import annotations

from pathlib import Path

import pytest

# Modules whose tests read the same session fixture or cached graph: the resnet18
# bias-only lowering, the CIFAR and demo lowerings, the SiLU block's edge program, the
# finished finetune run.
SHARED_GROUPS = {
    "test_zoo": "resnet18_bias_only",
    "test_max_pool_zoo": "resnet18_bias_only",
    "test_max_pool_forward": "cifar_and_demo_on_sm8650",
    "test_training": "cifar_and_demo_on_sm8650",
    "test_weight_layout": "cifar_and_demo_on_sm8650",
    "test_sigmoid": "silu_block",
    "test_distribute_mul": "silu_block",
    "test_finetune_tool": "finetune_run",
    "test_device_train": "finetune_run",
}

# Rough cost of one test, to start the longest units first: an htp test compiles for
# QNN and often runs the simulator (5-60 s), a quick one takes well under a second,
# a skipped one nothing.
COST_HTP, COST_QUICK = 30, 1


def unit_of(nodeid: str) -> str:
    """The unit of work of a test: its module's name, or the group it shares."""
    module = Path(nodeid.split("::", 1)[0]).stem
    return SHARED_GROUPS.get(module, module)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under ``--dist loadscope`` (pyproject's addopts): xdist's scope scheduler, with
    our units as its scopes."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroups(LoadScopeScheduling):
        # xdist's hook point for the scope of a node id (xdist 3.8.0)
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return ModuleGroups(config, log)


def _cost(item) -> int:
    if item.get_closest_marker("skip") is not None:
        return 0
    return COST_HTP if "htp" in item.keywords else COST_QUICK


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    """Order the units left after selection by their estimated cost, longest first,
    each unit's tests in their order. A unit goes to whichever worker is free, so the
    last one handed out decides how long the other workers wait at the end. (xdist's
    own reordering counts tests alone: ``--no-loadscope-reorder`` keeps this order.)"""
    totals: dict[str, int] = {}
    first: dict[str, int] = {}
    for index, item in enumerate(items):
        unit = unit_of(item.nodeid)
        totals[unit] = totals.get(unit, 0) + _cost(item)
        first.setdefault(unit, index)
    items.sort(key=lambda item: (-totals[unit_of(item.nodeid)], first[unit_of(item.nodeid)]))
