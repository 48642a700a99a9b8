"""The units of work of ``tests/scheduling.py`` hold on real xdist workers.

A small suite of four modules (two of them a shared group) runs on two workers with
the suite's own options; every test records the worker that ran it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import scheduling

TESTS = Path(__file__).resolve().parent

_MODULE = """
import json, os, time
import pytest

@pytest.mark.parametrize("i", range(6))
def test_record(i):
    time.sleep(0.05)
    with open(os.environ["RECORD"], "a") as f:
        f.write(json.dumps([__name__, i, os.environ["PYTEST_XDIST_WORKER"]]) + "\\n")
"""


def test_unit_is_the_module_or_its_shared_group():
    assert scheduling.unit_of("tests/test_core.py::test_x[a-b]") == "test_core"
    assert scheduling.unit_of("tests/test_zoo.py::test_y") == "resnet18_bias_only"
    assert scheduling.unit_of("tests/test_max_pool_zoo.py::T::test_z") == "resnet18_bias_only"


def test_each_unit_runs_whole_on_one_worker(tmp_path):
    pytest.importorskip("xdist")
    # two modules of their own, two that share a group (names from SHARED_GROUPS)
    names = ["test_alpha", "test_beta", "test_zoo", "test_max_pool_zoo"]
    assert scheduling.unit_of("test_zoo.py") == scheduling.unit_of("test_max_pool_zoo.py")
    for name in names:
        (tmp_path / f"{name}.py").write_text(_MODULE)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    record = tmp_path / "record.jsonl"
    env = {**os.environ, "RECORD": str(record), "PYTHONPATH": str(TESTS)}
    command = [sys.executable, "-m", "pytest", "-q"]
    for unused in ("cacheprovider", "hypothesispytest", "hydra_pytest", "anyio", "kgb"):
        command += ["-p", f"no:{unused}"]
    command += ["-p", "scheduling", "-n", "2", "--dist", "loadscope", "--no-loadscope-reorder"]
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(rows) == 6 * len(names)
    workers: dict[str, set[str]] = {}
    for module, _, worker in rows:
        workers.setdefault(scheduling.unit_of(f"{module}.py"), set()).add(worker)
    assert set(workers) == {"test_alpha", "test_beta", "resnet18_bias_only"}
    assert all(len(ran_on) == 1 for ran_on in workers.values()), workers
    # both workers were used: the units were shared out, not all sent to one
    assert len(set().union(*workers.values())) == 2, workers
