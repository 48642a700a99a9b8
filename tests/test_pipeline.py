"""``qnn_convbwd.pipeline``: every stage declared once, in order, and the hooks it fills."""

from __future__ import annotations

import typing
from pathlib import Path

from qnn_convbwd import integration, pipeline

CONTRIBUTING = Path(__file__).resolve().parents[1] / "docs" / "contributing.md"


def test_stages_are_listed_in_the_order_of_their_points():
    points = [stage.point for stage in pipeline.stages()]
    assert set(points) == set(pipeline.POINTS)
    ranks = [pipeline.POINTS.index(point) for point in points]
    assert ranks == sorted(ranks)
    names = [(stage.point, stage.name) for stage in pipeline.stages()]
    assert len(set(names)) == len(names)
    assert all(stage.why for stage in pipeline.stages())


def test_hooks_fill_every_integration_point():
    """A ``Hooks`` field no stage fills would be an integration point silently unused."""
    hooks = pipeline.hooks()
    fields = typing.get_type_hints(integration.Hooks)
    unfilled = [name for name in fields if getattr(hooks, name, None) in (None, (), {})]
    assert not unfilled


def test_edge_passes_run_in_the_declared_order_with_canonicalize_last():
    hooks = pipeline.hooks()
    declared = [s.run for s in pipeline.at("edge")]
    assert list(hooks.transform_passes) == declared
    assert declared[-1].__name__ == "CanonicalizeConvolutionBackward"
    assert declared[-1].steps == tuple(s.run for s in pipeline.at("canonicalize"))
    assert list(hooks.late_transform_passes) == [s.run for s in pipeline.at("late")]


def test_after_partition_runs_its_steps_in_order(monkeypatch):
    calls = []
    stages = pipeline.stages()
    traced = tuple(
        stage.__class__(**{**stage.__dict__, "run": _recorder(calls, stage.name)})
        if stage.point == "after_partition"
        else stage
        for stage in stages
    )
    monkeypatch.setattr(pipeline, "stages", lambda: traced)
    tags = {"tag": None}
    pipeline.hooks().after_partition("program", tags)
    assert calls == [(s.name, "program", tags) for s in pipeline.at("after_partition")]


def _recorder(calls: list, name: str):
    return lambda program, tags: calls.append((name, program, tags))


def test_unknown_point_is_an_error():
    try:
        pipeline.at("later")
    except ValueError as err:
        assert "later" in str(err) and "after_partition" in str(err)
    else:
        raise AssertionError("no error")


def test_the_contributors_guide_shows_the_current_stages():
    """docs/contributing.md holds ``pipeline.describe()``'s table; regenerate it there
    when a stage changes."""
    assert pipeline.describe() in CONTRIBUTING.read_text()
