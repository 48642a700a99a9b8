"""Shared fixtures and the test tiers.

``htp``: needs the real QNN compiler, simulator or Saver. Every test using the
``qnn_sdk`` fixture (directly or through another fixture) gets the mark here;
tests that reach the toolchain otherwise carry it explicitly.
``slow``: long runs, skipped unless ``--slow`` is given: the long property runs,
and sweeps that repeat one simulator check over more SoCs or configurations than
the default tier's representative ones, and the long checks ``tiers.LONG`` lists
with the default-tier check that covers the same path. ``pytest.mark.slow(reason=...)``
says which; the skip names it.
``sweep``: the zoo fidelity sweep (``tests/test_zoo_sweep.py``), skipped
unless ``--sweep`` is given: 48 lowerings of torchvision models, hours.
``python -m pytest -m "not htp"`` is the quick tier (no QNN compile).
The compiled-context cache is off (``QNN_CONVBWD_CONTEXT_CACHE=0`` unless set).

Workers: ``-n auto --dist loadscope`` (pyproject's addopts) runs one pytest-xdist
worker per core, at most ``MAX_WORKERS`` (each holds torch, executorch and QNN
compiles, 1-2 GB); ``tests/scheduling.py`` decides which tests run together on one
worker (a module, or modules sharing a fixture) and in which order. ``-n 0`` runs
in one process (debuggers, ``-s``).
"""

from __future__ import annotations

import functools
import os
import sys

import pytest
import scheduling

MAX_WORKERS = 4

# Every lowering in the tests compiles its QNN graphs: a binary reused from an earlier
# run would not test the compile, and would make runs depend on each other. The tests
# of the cache itself (test_context_cache.py) turn it on with a directory of their own.
os.environ.setdefault("QNN_CONVBWD_CONTEXT_CACHE", "0")


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="run the long property runs")
    parser.addoption(
        "--sweep", action="store_true", help="run the zoo fidelity sweep (hours; -k selects rows)"
    )


def _cores() -> int:
    """The cores this process may use."""
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    return len(cores) if cores else (os.cpu_count() or 1)


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: the cores this process may use, at most MAX_WORKERS."""
    return max(1, min(_cores(), MAX_WORKERS))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if "qnn_sdk" in getattr(item, "fixturenames", ()) and "htp" not in item.keywords:
            item.add_marker(pytest.mark.htp)
    if not config.getoption("--sweep"):
        sweep = pytest.mark.skip(
            reason="zoo fidelity sweep (48 lowerings, hours of QAIRT): select with --sweep"
        )
        for item in items:
            if item.get_closest_marker("sweep") is not None:
                item.add_marker(sweep)
    _mark_long(items)
    if config.getoption("--slow"):
        return
    for item in items:
        mark = item.get_closest_marker("slow")
        if mark is not None:
            why = mark.kwargs.get("reason")
            what = f"long run ({why})" if why else "long run"
            item.add_marker(pytest.mark.skip(reason=f"{what}: select with --slow"))


def _mark_long(items) -> None:
    """Mark ``slow`` the tests ``tiers.LONG`` names (``tests/test_tiers.py`` checks that
    each entry names a test)."""
    from tiers import LONG

    for item in items:
        reason = LONG.get(item.nodeid)
        if reason is not None:
            item.add_marker(pytest.mark.slow(reason=reason))


def pytest_configure(config):
    config.pluginmanager.register(scheduling, "qnn_convbwd_scheduling")
    _share_the_cores_between_workers()


def _share_the_cores_between_workers() -> None:
    """On an xdist worker, torch's CPU thread pool gets the worker's share of the cores
    (``OMP_NUM_THREADS``, unless set): each worker would otherwise start one thread per
    core, and the workers' threads then compete for the same cores."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, _cores() // int(workers))
    os.environ["OMP_NUM_THREADS"] = str(threads)  # this process's torch, and its children
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)


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


@pytest.fixture(scope="session")
def resnet18_bias_only():
    """``zoo.bias_only("resnet18")`` at 32x32, built once for test_zoo and test_max_pool_zoo."""
    from qnn_convbwd_dev import zoo

    try:
        return zoo.bias_only("resnet18", 32)
    except zoo.TorchvisionUnavailable as err:
        pytest.skip(str(err))


@pytest.fixture(scope="session")
def resnet18_bias_only_on_sm8650(qnn_sdk, resnet18_bias_only):
    """That graph lowered for SM8650 and run once on the simulator: (compiled, outputs).
    test_zoo checks every tensor's fidelity, test_max_pool_zoo the pool backward's."""
    from qnn_convbwd.toolchain import harness

    compiled = harness.lower_program(resnet18_bias_only.program, "SM8650")
    return compiled, compiled.run(list(resnet18_bias_only.inputs))


@pytest.fixture(scope="session")
def finetune_run(qnn_sdk, tmp_path_factory):
    """One finished ``qnn-convbwd finetune --cpu`` run of test_finetune_tool's small model
    on its digit folders: ((train folder, held-out folder), out folder, printed output).
    test_finetune_tool checks its outputs, test_device_train trains its train.pte on the
    fake device."""
    import test_finetune_tool as tool

    root = tmp_path_factory.mktemp("digits")
    folders = tool.make_folder(root / "train", 20), tool.make_folder(root / "val", 5, offset=20)
    out = tmp_path_factory.mktemp("run") / "run"
    code, printed = tool._main(tool.run_args(*folders, out))
    assert code == 0, printed
    return folders, out, printed


@pytest.fixture(scope="session")
def cifar_on_sm8650(qnn_sdk):
    """``lowered(trainable)``: ExecuTorch's CIFAR-10 model (``models.cifar_case``), its
    joint program and a copy of it lowered for SM8650, once per scheme and session;
    test_max_pool_forward checks the trainable one's fidelity, test_training trains
    both. The program itself stays as exported."""
    import copy

    from qnn_convbwd.toolchain import harness
    from qnn_convbwd_dev import models

    @functools.cache
    def lowered(trainable: bool):
        case = models.cifar_case(trainable)
        program = case.joint()
        return case, program, harness.lower_program(copy.deepcopy(program), "SM8650")

    return lowered


@pytest.fixture(scope="session")
def demo_on_sm8650(qnn_sdk):
    """``lowered(trainable)``: the demo adapter case (``models.adapter_case("demo")``)
    lowered for SM8650 with the default options, its QNN graphs captured, once per scheme
    and session: (case, lowering, QNN graphs, delegate inputs, .pte), the delegate inputs
    as test_training's ``delegate_inputs`` reads them before ``to_executorch`` renames the
    nodes. test_training checks and trains both, test_weight_layout compares the
    trainable one with its lowering in torch's layout."""
    import test_training

    from qnn_convbwd import integration, lower
    from qnn_convbwd.toolchain import harness
    from qnn_convbwd_dev import models

    @functools.cache
    def lowered(trainable: bool):
        case = models.adapter_case("demo", trainable=trainable)
        with integration.capture_qnn_graphs() as graphs:
            result = lower(case.joint(), harness.compile_specs("SM8650"))
        inputs = test_training.delegate_inputs(result.edge)
        pte = result.edge.to_executorch().buffer
        return case, result, graphs, inputs, pte

    return lowered
