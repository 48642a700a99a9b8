"""The cache of whole lowerings (qnn_convbwd.lowering_cache).

The conftest turns the caches off for the suite; these tests turn them on, each with
a directory of its own. The model is a small CNN in ``train()``: a frozen stem (its
weight a static tensor), batch norm with running statistics other than their
defaults (buffers whose initial values the ``.pte`` holds), a max pool and dropout
(its seed drawn from torch's RNG unless given).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import qnn_convbwd
from qnn_convbwd import context_cache, integration, lowering_cache, progress, training
from qnn_convbwd.passes import dropout
from qnn_convbwd.toolchain import harness

ROOT = Path(__file__).resolve().parent.parent
SOC = "SM8650"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.conv = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.25)
        self.fc = nn.Linear(8 * 4 * 4, 10)
        self.stem.requires_grad_(False)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(torch.relu(self.stem(x)))))
        x = nn.functional.max_pool2d(x, 2)
        return self.fc(self.drop(torch.flatten(x, 1)))


def _module() -> nn.Module:
    torch.manual_seed(0)
    net = Net().train()
    with torch.no_grad():
        net.bn.running_mean.uniform_(-0.5, 0.5)
        net.bn.running_var.uniform_(0.5, 2.0)
    return training.WithLoss(net, nn.functional.cross_entropy)


def _batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(4, 3, 8, 8, generator=generator), torch.randint(
        0, 10, (4,), generator=generator
    )


def _joint(module: nn.Module | None = None) -> torch.export.ExportedProgram:
    return training.export_joint(module or _module(), _batch())


def _key(program, soc: str = SOC, skips=(None, None), **options) -> str:
    with qnn_convbwd.enabled(**{"dropout_seed": 7, **options}):
        parts = lowering_cache.key_parts(program, harness.compile_specs(soc), skips)
    return context_cache.key(parts)


# --- the key (no QNN compile) ---------------------------------------------------------


@functools.cache
def _unchanged() -> torch.export.ExportedProgram:
    """The unchanged program, exported once for the keys of the tests below (making a
    key reads the program and changes nothing in it)."""
    return _joint()


def _unchanged_key() -> str:
    return _key(_unchanged())


def test_the_key_is_the_same_for_the_same_program_exported_again():
    assert _key(_joint()) == _unchanged_key()


def _with_frozen_weight_changed() -> nn.Module:
    module = _module()
    with torch.no_grad():
        module.net.stem.weight.view(-1)[0] += 0.25
    return module


def _with_running_mean_changed() -> nn.Module:
    module = _module()
    module.net.bn.running_mean[0] += 0.25
    return module


def _with_another_parameter_trained() -> nn.Module:
    module = _module()
    module.net.stem.requires_grad_(True)
    return module


@pytest.mark.parametrize(
    "changed",
    [
        lambda: _key(_joint(_with_frozen_weight_changed())),
        lambda: _key(_joint(_with_running_mean_changed())),
        lambda: _key(_joint(_with_another_parameter_trained())),
        lambda: _key(_unchanged(), soc="SM8550"),
        lambda: _key(_unchanged(), stride="zero_insert"),
        lambda: _key(_unchanged(), skips=({"aten_convolution_default"}, None)),
        lambda: _key(_unchanged(), dropout_seed=8),
    ],
    ids=["frozen weight", "buffer", "trained set", "soc", "option", "skip set", "seed"],
)
def test_the_key_changes_with_what_lower_reads(changed):
    assert changed() != _unchanged_key()


def test_where_and_how_much_is_cached_is_not_in_the_key(tmp_path):
    program = _unchanged()
    assert _key(program, context_cache_dir=str(tmp_path), context_cache_bytes=10**6) == _key(
        program
    )


def test_a_seed_drawn_for_dropout_comes_from_torchs_rng_before_the_key(qnn_sdk, monkeypatch):
    """Without ``dropout_seed``, ``lower()`` draws the seed the dropout pass would draw,
    before the key is made: the same RNG state, the same key; torch's RNG advances as it
    would without the cache."""
    seen = []

    def through(program, specs, skips, lower, record, restore):
        seen.append(qnn_convbwd.options.current.dropout_seed)
        return None, restore({"rows": [], "on_cpu": [], "fallbacks": []})

    monkeypatch.setattr(lowering_cache, "through", through)
    program = _joint()
    assert dropout.draws(program)
    torch.manual_seed(3)
    expected, after = dropout.fresh_seed(), torch.rand(())
    torch.manual_seed(3)
    with qnn_convbwd.enabled(dropout_seed=None):
        qnn_convbwd.lower(program, harness.compile_specs(SOC))
    assert seen == [expected]
    assert torch.rand(()) == after
    with qnn_convbwd.enabled(dropout_seed=11):
        qnn_convbwd.lower(program, harness.compile_specs(SOC))
    assert seen[-1] == 11


def test_a_report_that_is_no_json_data_is_returned_and_not_stored(qnn_sdk, tmp_path, caplog):
    """A dynamic program's report holds symbolic sizes: the lowering is returned as it
    is, and nothing is stored."""
    lowered = (object(), object())

    def record(report):
        raise TypeError("Object of type SymInt is not JSON serializable")

    with (
        qnn_convbwd.enabled(context_cache_dir=str(tmp_path)),
        pytest.MonkeyPatch.context() as patch,
        caplog.at_level(logging.INFO, logger=lowering_cache.__name__),
    ):
        patch.setenv(context_cache.ENV_SWITCH, "1")
        found = lowering_cache.through(
            _joint(), harness.compile_specs(SOC), (None, None), lambda: lowered, record, dict
        )
    assert found == lowered
    assert "not stored (report: TypeError" in caplog.text
    assert context_cache.entries(tmp_path) == []


# --- entries that do not load ------------------------------------------------------


def test_an_entry_that_does_not_load_is_deleted(tmp_path, caplog, monkeypatch):
    key = "ab" * 32
    context_cache.store(key, b"not a saved program", {"kind": lowering_cache.KIND}, root=tmp_path)
    with (
        qnn_convbwd.enabled(context_cache_dir=str(tmp_path)),
        caplog.at_level(logging.WARNING, logger=lowering_cache.__name__),
    ):
        assert lowering_cache.lookup(key) is None
    assert "does not load" in caplog.text
    assert context_cache.entries(tmp_path) == []


# --- lowerings on the HTP compiler and simulator -----------------------------------


def _lower(root: Path, **options) -> tuple[training.TrainingProgram, list[str]]:
    events: list[progress.Event] = []
    with (
        qnn_convbwd.enabled(context_cache_dir=str(root), dropout_seed=5, **options),
        progress.observe(events.append),
    ):
        program = training.lower_for_training(_module(), _batch(), harness.compile_specs(SOC))
    return program, [e.phase for e in events]


@pytest.fixture(scope="module")
def first(qnn_sdk, tmp_path_factory):
    root = tmp_path_factory.mktemp("lowerings")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(context_cache.ENV_SWITCH, "1")
        program, phases = _lower(root)
    return root, program, phases


def _steps(program: training.TrainingProgram, count: int = 3) -> tuple[list[float], dict]:
    session = program.session(0.05, momentum=0.9)
    losses = [session.step(_batch(seed)) for seed in range(2, 2 + count)]
    return losses, session.state_dict()


@pytest.mark.htp
def test_the_first_lowering_stores_one_lowering_and_one_context(first):
    root, program, phases = first
    assert progress.FINALIZE in phases and progress.CACHE_HIT not in phases
    kinds = sorted(e.about.get("kind", "context") for e in context_cache.entries(root))
    assert kinds == ["context", lowering_cache.KIND]
    (stored,) = [e for e in context_cache.entries(root) if e.about.get("kind")]
    assert stored.about["delegates"] == harness.delegate_count(program.edge) == 1


@pytest.mark.htp
def test_the_same_program_again_is_read_back_and_trains_the_same(first, monkeypatch):
    monkeypatch.setenv(context_cache.ENV_SWITCH, "1")
    root, before, _ = first
    again, phases = _lower(root)
    assert progress.CACHE_HIT in phases
    for skipped in (progress.PARTITION, progress.BUILD, progress.FINALIZE):
        assert skipped not in phases, phases
    assert again.pte == before.pte
    assert again.report == before.report
    ours, theirs = _steps(again), _steps(before)
    assert ours[0] == theirs[0]
    assert ours[1].keys() == theirs[1].keys()
    for name, value in ours[1].items():
        assert torch.equal(value, theirs[1][name]), name


@pytest.mark.htp
def test_a_new_process_reads_it_back(first):
    root, before, _ = first
    child = f"""
import hashlib, json, sys
sys.path.insert(0, {str(ROOT / "tests")!r})
import qnn_convbwd
from qnn_convbwd import progress
import test_lowering_cache as t
phases = []
with progress.observe(lambda e: phases.append(e.phase)):
    program, _ = t._lower({str(root)!r})
print(json.dumps([hashlib.sha256(program.pte).hexdigest(), phases]))
"""
    done = subprocess.run(
        [sys.executable, "-c", child],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, context_cache.ENV_SWITCH: "1", "PYTHONPATH": str(ROOT)},
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    digest, phases = json.loads(done.stdout.strip().splitlines()[-1])
    assert digest == hashlib.sha256(before.pte).hexdigest()
    assert progress.CACHE_HIT in phases and progress.FINALIZE not in phases


@pytest.mark.htp
def test_a_lowering_whose_qnn_graphs_are_captured_is_built(first, monkeypatch):
    """A tool capturing the QNN graphs (cost, the tests) needs them built: no hit."""
    monkeypatch.setenv(context_cache.ENV_SWITCH, "1")
    root, _, _ = first
    with integration.capture_qnn_graphs() as graphs:
        _, phases = _lower(root)
    assert progress.BUILD in phases
    assert len(graphs) == 1 and graphs[0]


@pytest.mark.htp
def test_switched_off_it_stores_no_lowering(qnn_sdk, monkeypatch, tmp_path):
    monkeypatch.setenv(context_cache.ENV_SWITCH, "1")
    _, phases = _lower(tmp_path, lowering_cache=False)
    assert progress.FINALIZE in phases
    assert [e.about.get("kind") for e in context_cache.entries(tmp_path)] == [None]


def test_a_program_whose_read_back_emits_other_bytes_is_not_stored(
    qnn_sdk, monkeypatch, tmp_path, caplog
):
    """What executorch's serialisation drops is put back; were anything else lost, the
    check before storing would refuse the entry. Simulated by losing the record of
    which values require a gradient."""
    monkeypatch.setenv(context_cache.ENV_SWITCH, "1")
    monkeypatch.setattr(lowering_cache, "_restore", lambda program, record: None)
    with (
        qnn_convbwd.enabled(context_cache_dir=str(tmp_path)),
        caplog.at_level(logging.WARNING, logger=lowering_cache.__name__),
    ):
        # V68: everything on CPU, nothing to compile; the check is the same.
        result = qnn_convbwd.lower(_joint(), harness.compile_specs("SM8350"))
    assert "emits another .pte" in caplog.text
    assert [e.about.get("kind") for e in context_cache.entries(tmp_path)] == []
    assert harness.delegate_count(result.edge) == 0
