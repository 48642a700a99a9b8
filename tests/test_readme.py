"""The README lists every place the plugin reaches into executorch."""

from __future__ import annotations

from pathlib import Path

from qnn_convbwd import integration

README = Path(__file__).resolve().parent.parent / "README.md"


def test_every_executorch_internal_is_listed_in_the_readme():
    text = README.read_text()
    section = text.split("## Where the plugin reaches into executorch", 1)[1].split("\n## ", 1)[0]
    missing = [
        f"{module}.{name}"
        for module, name, _ in integration.INTERNALS
        if f"`{name}`" not in section and f" {name}`" not in section and f"`{name}," not in section
    ]
    assert not missing, f"README does not list: {missing}"


def test_readme_names_the_setup_test_and_main_commands():
    text = README.read_text()
    for command in ("./scripts/setup.sh", "python -m pytest -q", "qnn-convbwd demo"):
        assert command in text
