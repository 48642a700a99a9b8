"""A program's delegates finalised in forked processes (``parallel_finalize``).

Without the SDK, ``preprocess`` runs a stand-in for executorch's
``preprocess_multimethod``: the results must come back in the partitions' order,
a child's error must be raised naming its delegate, a child killed before it
answers must be redone in process, and the fallbacks a child's builders record
must reach the parent's report. With the simulator, a program of several
delegates lowered with two workers must train exactly as the one lowered in
process.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

import qnn_convbwd
from qnn_convbwd import integration, options, parallel_finalize, progress, training
from qnn_convbwd.partition import judge
from qnn_convbwd.toolchain import harness
from qnn_convbwd_dev import models

SOC = "SM8650"


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True])
def test_finalize_workers_is_validated(value):
    with pytest.raises(ValueError, match="finalize_workers"):
        options.Options(finalize_workers=value)


@pytest.fixture
def two_workers(monkeypatch):
    """``preprocess`` free to fork (no SDK: the checks on compile specs are skipped)."""
    monkeypatch.setattr(parallel_finalize, "_why_target_in_process", lambda specs: "")
    with qnn_convbwd.enabled(finalize_workers=2):
        yield


def _partitions(count: int) -> tuple[dict, dict]:
    programs = {"forward": [f"program {i}" for i in range(count)]}
    specs = {"forward": [[f"specs {i}"] for i in range(count)]}
    return programs, specs


def _answer(edge_programs: dict, compile_specs: dict) -> dict:
    """Stands in for executorch's preprocess: one result per partition, naming the
    partition, its specs and the process that made it."""
    pid = os.getpid()
    return {
        method: [(program, compile_specs[method][i][0], pid) for i, program in enumerate(programs)]
        for method, programs in edge_programs.items()
    }


def test_results_come_back_in_partition_order_from_child_processes(two_workers):
    programs, specs = _partitions(5)
    events = []
    with progress.observe(events.append), progress.run():
        results = parallel_finalize.preprocess(_answer, programs, specs)
    assert [r[:2] for r in results["forward"]] == [(f"program {i}", f"specs {i}") for i in range(5)]
    pids = {r[2] for r in results["forward"]}
    assert os.getpid() not in pids and len(pids) == 5
    counts = [e.delegate for e in events if e.phase == progress.PARALLEL]
    assert counts == [0, 1, 2, 3, 4, 5] and events[-1].phase == progress.DONE


def test_an_observed_build_stays_in_process(two_workers):
    programs, specs = _partitions(3)
    results = parallel_finalize.preprocess(_answer, programs, specs, build_observed=True)
    assert {r[2] for r in results["forward"]} == {os.getpid()}


def test_one_worker_or_one_partition_stays_in_process():
    with qnn_convbwd.enabled(finalize_workers=1):
        assert parallel_finalize._why_in_process(3, [], False) == "one worker"
    with qnn_convbwd.enabled(finalize_workers=4):
        assert parallel_finalize._why_in_process(1, [], False) == "one delegate"
        assert "observed" in parallel_finalize._why_in_process(3, [], True)


def test_a_child_error_is_raised_naming_its_delegate(two_workers):
    def fails_on_third(edge_programs, compile_specs):
        if edge_programs["forward"] == ["program 2"]:
            raise ValueError("QNN op validation failed")
        return _answer(edge_programs, compile_specs)

    programs, specs = _partitions(4)
    with pytest.raises(ValueError, match="QNN op validation failed") as raised:
        parallel_finalize.preprocess(fails_on_third, programs, specs)
    assert any("delegate 3/4" in note for note in raised.value.__notes__)


def test_a_killed_child_is_redone_in_process(two_workers):
    parent = os.getpid()

    def killed_on_second(edge_programs, compile_specs):
        if edge_programs["forward"] == ["program 1"] and os.getpid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
        return _answer(edge_programs, compile_specs)

    programs, specs = _partitions(3)
    results = parallel_finalize.preprocess(killed_on_second, programs, specs)
    assert [r[0] for r in results["forward"]] == ["program 0", "program 1", "program 2"]
    assert results["forward"][1][2] == parent
    assert parent not in (results["forward"][0][2], results["forward"][2][2])


def test_fallbacks_recorded_in_a_child_reach_the_parent(two_workers):
    graph = torch.fx.symbolic_trace(torch.nn.ReLU()).graph
    node = next(n for n in graph.nodes if n.op == "call_function" or n.op == "call_module")

    def records(edge_programs, compile_specs):
        judge.record_fallback(node, 'stride="phases"', 'stride="zero_insert"', "a test")
        return _answer(edge_programs, compile_specs)

    programs, specs = _partitions(2)
    with judge.recording():
        parallel_finalize.preprocess(records, programs, specs)
        found = judge.recorded_fallbacks()
    assert [(f.node, f.asked, f.built) for f in found] == [
        (node.name, 'stride="phases"', 'stride="zero_insert"')
    ]


def _lower(case, workers: int):
    with qnn_convbwd.enabled(max_delegate_ops=6, finalize_workers=workers):
        return harness.lower_program(case.joint(), SOC)


@pytest.mark.htp
def test_parallel_program_trains_exactly_as_the_in_process_one(qnn_sdk):
    """Nine delegates, finalised two at a time in forked processes: the same report,
    and the same losses and updates to the bit as the program finalised in process."""
    case = models.adapter_case("demo", trainable=True)
    alone = _lower(case, 1)
    events = []
    with progress.observe(events.append):
        spread = _lower(case, 2)
    delegates = harness.delegate_count(spread.edge)
    assert delegates == harness.delegate_count(alone.edge) >= 3
    done = [e.delegate for e in events if e.phase == progress.PARALLEL]
    assert done[-1] == delegates, done
    assert spread.report.rows == alone.report.rows
    assert spread.report.on_cpu == alone.report.on_cpu
    assert spread.report.fallbacks == alone.report.fallbacks
    one = training.train_side_by_side(alone.pte, case.model, case.inputs, 3, 0.1)
    two = training.train_side_by_side(spread.pte, case.model, case.inputs, 3, 0.1)
    assert [s.loss for s in one.steps] == [s.loss for s in two.steps]
    for name, (ours, _) in two.updates.items():
        assert torch.equal(ours, one.updates[name][0]), name


@pytest.mark.htp
def test_forked_finalisation_stores_and_reuses_context_binaries(qnn_sdk, monkeypatch, tmp_path):
    """The children compile through the context cache: a first lowering stores one
    entry per delegate, a second takes them (QAIRT's binaries differ from one compile
    to the next, so equal binaries mean reuse)."""
    from qnn_convbwd import context_cache

    monkeypatch.setenv(context_cache.ENV_SWITCH, "1")
    case = models.adapter_case("demo", trainable=False)

    def binaries():
        with qnn_convbwd.enabled(
            max_delegate_ops=15,
            finalize_workers=2,
            context_cache_dir=str(tmp_path),
            lowering_cache=False,
        ):
            return harness.context_binaries(harness.lower_program(case.joint(), SOC).edge)

    first = binaries()
    assert len(first) >= 2
    assert len(context_cache.entries(tmp_path)) == len(first)
    assert binaries() == first


def test_default_workers_are_the_cores_at_most_four(monkeypatch):
    for cores, expected in ((1, 1), (2, 2), (16, parallel_finalize.DEFAULT_WORKERS)):
        monkeypatch.setattr(parallel_finalize, "available_cores", lambda cores=cores: cores)
        with qnn_convbwd.enabled(finalize_workers=None):
            assert parallel_finalize.workers() == expected
    with qnn_convbwd.enabled(finalize_workers=7):
        assert parallel_finalize.workers() == 7


@pytest.mark.htp
def test_qnn_graphs_captured_around_the_lowering_are_all_seen(qnn_sdk):
    """``capture_qnn_graphs`` entered before the plugin is installed wraps the build
    underneath the plugin's: the delegates are then built in process, every one seen."""
    case = models.adapter_case("demo", trainable=True)
    with integration.capture_qnn_graphs() as graphs:
        lowered = _lower(case, 2)
    assert len(graphs) == harness.delegate_count(lowered.edge) >= 3
    assert all(graphs)
