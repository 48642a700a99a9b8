"""The compiled-context cache (qnn_convbwd.context_cache) and a lowering's progress.

The conftest turns the cache off for the suite; these tests turn it on, each with a
directory of its own. Which QNN graphs were compiled and which were taken from the
cache is read from the lowering's progress events (``finalize`` or ``cache hit``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import io
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import qnn_convbwd
from qnn_convbwd import context_cache, lowering_cache, progress
from qnn_convbwd.toolchain import harness
from qnn_convbwd_dev import models

ROOT = Path(__file__).resolve().parent.parent
SOC = "SM8650"


# --- entries on disk (no QNN) ----------------------------------------------------


def _key(n: int) -> str:
    return hashlib.sha256(str(n).encode()).hexdigest()  # keys differ in their listed prefix


def test_an_entry_round_trips(tmp_path):
    binary = os.urandom(3000)
    context_cache.store(_key(1), binary, {"soc": "SM8650"}, root=tmp_path)
    assert context_cache.load(_key(1), root=tmp_path) == binary
    assert context_cache.load(_key(2), root=tmp_path) is None
    assert not list(tmp_path.glob(".tmp-*"))  # the temporary file was renamed into place


def _corrupt_truncated(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-10])


def _corrupt_flipped(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))


def _corrupt_renamed(path: Path) -> None:
    path.rename(path.with_name(f"{_key(2)}{context_cache.SUFFIX}"))


def _corrupt_garbage(path: Path) -> None:
    path.write_bytes(b"not an entry at all")


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (_corrupt_truncated, "header says"),
        (_corrupt_flipped, "checksum mismatch"),
        (_corrupt_renamed, "wrong key"),
        (_corrupt_garbage, "bad magic"),
    ],
)
def test_a_bad_entry_is_detected_logged_and_deleted(tmp_path, caplog, corrupt, message):
    context_cache.store(_key(1), os.urandom(3000), {}, root=tmp_path)
    corrupt(tmp_path / f"{_key(1)}{context_cache.SUFFIX}")
    (path,) = tmp_path.glob(f"*{context_cache.SUFFIX}")
    with caplog.at_level(logging.WARNING, logger=context_cache.__name__):
        assert context_cache.load(path.name[: -len(context_cache.SUFFIX)], root=tmp_path) is None
    assert message in caplog.text
    assert not path.exists()


def test_the_size_bound_evicts_the_least_recently_used(tmp_path):
    size = 1000
    for n in (1, 2, 3):
        context_cache.store(_key(n), os.urandom(size), {}, root=tmp_path)
        os.utime(tmp_path / f"{_key(n)}{context_cache.SUFFIX}", (n, n))  # 1 oldest
    # Room for three entries, not four (the headers differ by a few bytes).
    limit = 3 * max(e.size for e in context_cache.entries(tmp_path)) + 16
    assert context_cache.load(_key(1), root=tmp_path) is not None  # 1 used now: 2 is oldest
    context_cache.store(_key(4), os.urandom(size), {}, root=tmp_path, limit=limit)
    kept = {e.key for e in context_cache.entries(tmp_path)}
    assert kept == {_key(1), _key(3), _key(4)}
    assert sum(e.size for e in context_cache.entries(tmp_path)) <= limit


def test_a_binary_larger_than_the_bound_is_not_stored(tmp_path):
    context_cache.store(_key(1), os.urandom(5000), {}, root=tmp_path, limit=1000)
    assert context_cache.entries(tmp_path) == []


def test_switches(monkeypatch):
    monkeypatch.setenv(context_cache.ENV_SWITCH, "1")
    assert context_cache.enabled()
    monkeypatch.setattr(
        qnn_convbwd.options, "current", qnn_convbwd.options.Options(context_cache=False)
    )
    assert not context_cache.enabled()
    monkeypatch.setattr(qnn_convbwd.options, "current", qnn_convbwd.options.Options())
    monkeypatch.setenv(context_cache.ENV_SWITCH, "0")
    assert not context_cache.enabled()


def _cli(*args: str) -> str:
    """``python -m qnn_convbwd.cli cache ...`` in a new process: its standard output."""
    done = subprocess.run(
        [sys.executable, "-m", "qnn_convbwd.cli", "cache", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _cli_here(*args: str) -> str:
    """The same command run by ``cli.main`` in this process: its standard output."""
    import contextlib

    from qnn_convbwd import cli

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert cli.main(["cache", *args]) == 0
    return buffer.getvalue()


def test_cli_lists_and_clears(tmp_path):
    context_cache.store(_key(1), os.urandom(2048), {"soc": "SM8650", "ops": 7}, root=tmp_path)
    context_cache.store(_key(2), os.urandom(1024), {"soc": "SM8550", "ops": 3}, root=tmp_path)
    lowering = {"kind": lowering_cache.KIND, "soc": "SM8850", "ops": 5, "delegates": 2}
    context_cache.store(_key(3), os.urandom(512), lowering, root=tmp_path)
    listing = _cli("list", "--dir", str(tmp_path))
    assert "3 entries" in listing
    assert _key(1)[:16] in listing and _key(2)[:16] in listing
    assert "SM8650" in listing and "SM8550" in listing
    (line,) = [row for row in listing.splitlines() if row.startswith(_key(3)[:16])]
    assert "lowering" in line and "SM8850" in line and "2 delegate(s)" in line
    assert "deleted 3 entries" in _cli_here("clear", "--dir", str(tmp_path))
    assert context_cache.entries(tmp_path) == []
    assert "0 entries" in _cli_here("list", "--dir", str(tmp_path))


# --- lowerings on the HTP compiler and simulator ----------------------------------


@dataclasses.dataclass
class Lowered:
    pte: bytes
    binaries: list[bytes]
    events: list[progress.Event]

    @property
    def compiled(self) -> list[str]:
        """One entry per delegate: ``finalize`` (QAIRT compiled it) or ``cache hit``."""
        return [e.phase for e in self.events if e.phase in (progress.FINALIZE, progress.CACHE_HIT)]


def lower(case: models.TrainingCase, root: Path, soc: str = SOC, **options) -> Lowered:
    """``lower()`` through the context cache alone (test_lowering_cache.py tests the
    cache of whole lowerings)."""
    events: list[progress.Event] = []
    with (
        qnn_convbwd.enabled(context_cache_dir=str(root), lowering_cache=False, **options),
        progress.observe(events.append),
    ):
        result = qnn_convbwd.lower(case.joint(), harness.compile_specs(soc))
    return Lowered(
        result.edge.to_executorch().buffer, harness.context_binaries(result.edge), events
    )


def frozen_case() -> models.TrainingCase:
    """The demo adapter over a frozen backbone: the backbone's weights are static tensors."""
    return models.adapter_case("demo", trainable=False)


@pytest.fixture(scope="module")
def first(qnn_sdk, tmp_path_factory):
    root = tmp_path_factory.mktemp("contexts")
    case = frozen_case()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(context_cache.ENV_SWITCH, "1")
        lowered = lower(case, root)
    return case, root, lowered


@pytest.fixture
def cache_on(monkeypatch):
    monkeypatch.setenv(context_cache.ENV_SWITCH, "1")


@pytest.mark.htp
def test_the_first_lowering_compiles_and_reports_its_phases(first):
    _, root, lowered = first
    assert lowered.compiled == [progress.FINALIZE]
    phases = [e.phase for e in lowered.events]
    for earlier, later in zip(
        (progress.EXPORT, progress.PARTITION, progress.BUILD, progress.FINALIZE),
        (progress.PARTITION, progress.BUILD, progress.FINALIZE, progress.DONE),
        strict=True,
    ):
        assert phases.index(earlier) < phases.index(later), phases
    build = next(e for e in lowered.events if e.phase == progress.BUILD)
    assert (build.delegate, build.delegates) == (1, 1)
    elapsed = [e.elapsed for e in lowered.events]
    assert elapsed == sorted(elapsed)
    (entry,) = context_cache.entries(root)
    assert entry.binary_size == len(lowered.binaries[0])


@pytest.mark.htp
def test_the_same_program_again_reuses_the_binary(first, cache_on):
    case, root, before = first
    again = lower(case, root)
    assert again.compiled == [progress.CACHE_HIT]
    assert again.binaries == before.binaries
    assert again.pte == before.pte
    inputs = [t.clone() for t in case.inputs]
    for ours, theirs in zip(
        harness.run_pte(again.pte, inputs), harness.run_pte(before.pte, inputs), strict=True
    ):
        assert torch.equal(ours, theirs)


@pytest.mark.htp
def test_a_changed_static_weight_compiles_again(first, cache_on):
    case, root, before = first
    changed = copy.deepcopy(case)
    frozen = [p for p in changed.model.parameters() if not p.requires_grad]
    assert frozen, "the case has no frozen (static) weight"
    with torch.no_grad():
        frozen[0].view(-1)[0] += 0.25
    after = lower(changed, root)
    assert after.compiled == [progress.FINALIZE]
    assert after.binaries != before.binaries


@pytest.mark.htp
def test_another_soc_compiles_again(first, cache_on):
    case, root, before = first
    after = lower(case, root, soc="SM8550")
    assert after.compiled == [progress.FINALIZE]
    assert after.binaries != before.binaries


@pytest.mark.htp
def test_another_option_compiles_again(first, cache_on):
    case, root, _ = first
    assert lower(case, root, htp_optimization=2).compiled == [progress.FINALIZE]


@pytest.mark.htp
def test_a_corrupt_entry_is_compiled_again(first, cache_on, tmp_path, caplog):
    case, root, before = first
    (entry,) = [
        e
        for e in context_cache.entries(root)
        if context_cache.load(e.key, root) == before.binaries[0]
    ]
    copied = tmp_path / entry.path.name
    data = bytearray(entry.path.read_bytes())
    data[-1] ^= 0xFF
    copied.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger=context_cache.__name__):
        after = lower(case, tmp_path)
    assert "checksum mismatch" in caplog.text
    assert after.compiled == [progress.FINALIZE]
    # Rebuilt under the same key (the binary itself differs from the first: executorch
    # names inserted ops from counters that run on within a process).
    assert context_cache.load(entry.key, root=tmp_path) == after.binaries[0]


@pytest.mark.htp
def test_the_environment_variable_turns_it_off(qnn_sdk, monkeypatch, tmp_path):
    monkeypatch.setenv(context_cache.ENV_SWITCH, "0")
    case = frozen_case()
    assert lower(case, tmp_path).compiled == [progress.FINALIZE]
    assert lower(case, tmp_path).compiled == [progress.FINALIZE]
    assert context_cache.entries(tmp_path) == []


def test_progress_observers_see_a_run_in_order():
    events: list[progress.Event] = []
    with progress.observe(events.append), progress.run():
        progress.phase(progress.EXPORT)
        progress.phase(progress.PARTITION)
        progress.partitioned(2)
        for _ in range(2):
            progress.phase(progress.BUILD, new_delegate=True)
            time.sleep(0.01)
            progress.phase(progress.FINALIZE)
    described = [e.describe().split(" (")[0] for e in events]
    assert described == [
        "export passes",
        "partition",
        "delegate 1/2: QNN graph build",
        "delegate 1/2: finalize",
        "delegate 2/2: QNN graph build",
        "delegate 2/2: finalize",
        "done",
    ]
    assert events[-1].elapsed >= 0.02


def test_the_cli_progress_line_follows_long_calls_without_replacing_them():
    """The CLI hears the package's long calls (``progress.long_call``) and their phases;
    no function of the package is swapped for a wrapper, and nothing is left observing."""
    from qnn_convbwd import api, cli
    from qnn_convbwd.toolchain import harness

    @progress.long_call("working")
    def work(nested: bool) -> int:
        if nested:  # an inner long call: the outer line stays
            return work(False)
        with progress.run():
            progress.phase(progress.EXPORT)
            progress.phase(progress.PARTITION)
        return 7

    originals = (api.lower, harness.lower_program, harness.run_pte)
    terminal = io.StringIO()
    with cli._progress(terminal):
        assert (api.lower, harness.lower_program, harness.run_pte) == originals
        assert work(True) == 7
    shown = terminal.getvalue()
    assert "working: export passes" in shown and "working: partition" in shown
    assert progress._call_observers == [] and progress._observers == []
    assert work(True) == 7 and terminal.getvalue() == shown  # no one observes now


@pytest.mark.htp
def test_the_cli_progress_line_names_phase_and_delegate(qnn_sdk, monkeypatch):
    from qnn_convbwd import api, cli

    monkeypatch.setenv(context_cache.ENV_SWITCH, "0")
    terminal = io.StringIO()
    with cli._progress(terminal):
        api.lower(frozen_case().joint(), harness.compile_specs(SOC))
    shown = terminal.getvalue()
    for text in ("lowering: export passes", "lowering: partition", "delegate 1/1: finalize"):
        assert text in shown, shown


@pytest.mark.htp
def test_split_delegates_each_reuse_their_binary(qnn_sdk, monkeypatch, tmp_path):
    """Lowered again in one process, the delegates' inserted ops have other names
    (graph outputs among them): the binaries are reused, and the program computes
    what a program compiled afresh with the new names computes. In process
    (``finalize_workers=1``), so that every delegate's phase is seen here; forked
    finalisation through the cache: test_parallel_finalize.py."""
    monkeypatch.setenv(context_cache.ENV_SWITCH, "1")
    case = frozen_case()
    lower = functools.partial(globals()["lower"], finalize_workers=1)
    before = lower(case, tmp_path, max_delegate_ops=15)
    count = len(before.binaries)
    assert count >= 2
    assert before.compiled == [progress.FINALIZE] * count
    builds = [e for e in before.events if e.phase == progress.BUILD]
    assert [(e.delegate, e.delegates) for e in builds] == [(k, count) for k in range(1, count + 1)]
    again = lower(case, tmp_path, max_delegate_ops=15)
    assert again.compiled == [progress.CACHE_HIT] * count
    assert again.binaries == before.binaries
    assert again.pte == before.pte
    assert len(context_cache.entries(tmp_path)) == count
    monkeypatch.setenv(context_cache.ENV_SWITCH, "0")
    fresh = lower(case, tmp_path, max_delegate_ops=15)
    assert fresh.compiled == [progress.FINALIZE] * count
    inputs = [t.clone() for t in case.inputs]
    for ours, theirs in zip(
        harness.run_pte(again.pte, inputs), harness.run_pte(fresh.pte, inputs), strict=True
    ):
        assert torch.equal(ours, theirs)


def _stock_lowering(program, specs) -> list[progress.Event]:
    """executorch's own flow, the plugin enabled: the events it reports."""
    from executorch.backends.qualcomm._passes.qnn_pass_manager import QnnPassManager
    from executorch.backends.qualcomm.partition.qnn_partitioner import QnnPartitioner
    from executorch.backends.qualcomm.utils.utils import qnn_edge_config
    from executorch.exir import to_edge_transform_and_lower

    events: list[progress.Event] = []
    passes = QnnPassManager()
    aten = passes.transform_for_export_pipeline(program)
    with progress.observe(events.append):
        to_edge_transform_and_lower(
            aten,
            transform_passes=passes.get_to_edge_transform_passes(aten, compiler_specs=specs),
            partitioner=[QnnPartitioner(specs)],
            compile_config=qnn_edge_config(),
        )
    return events


@pytest.mark.htp
def test_the_stock_flow_reports_progress_and_uses_the_cache(qnn_sdk, cache_on, tmp_path):
    case = frozen_case()
    specs = harness.compile_specs(SOC)
    with qnn_convbwd.enabled(context_cache_dir=str(tmp_path)):
        first = _stock_lowering(case.joint(), specs)
        again = _stock_lowering(case.joint(), specs)
    for events, compiled in ((first, progress.FINALIZE), (again, progress.CACHE_HIT)):
        phases = [e.phase for e in events]
        assert phases[0] == progress.EXPORT and phases[-1] == progress.DONE, phases
        assert [p for p in phases if p in (progress.FINALIZE, progress.CACHE_HIT)] == [compiled]
        assert events[0].elapsed < 1.0  # each lowering is a run of its own
    assert len(context_cache.entries(tmp_path)) == 1
