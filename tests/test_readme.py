"""The README and docs/ stay in step with the code."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from qnn_convbwd import integration

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
INTERNALS_DOC = ROOT / "docs" / "internals.md"


def test_every_executorch_internal_is_listed_in_the_internals_doc():
    text = INTERNALS_DOC.read_text()
    table = "\n".join(line for line in text.splitlines() if line.startswith("| `"))
    missing = [
        f"{module}.{name}"
        for module, name, _ in integration.INTERNALS
        if f"`{name}`" not in table and f" {name}`" not in table and f"`{name}," not in table
    ]
    assert not missing, f"docs/internals.md does not list: {missing}"


def test_readme_names_the_setup_test_and_main_commands():
    text = README.read_text()
    for command in (
        "./scripts/setup.sh",
        ". .venv/bin/activate && python -m pytest -q",
        ". .venv/bin/activate && qnn-convbwd demo",
    ):
        assert command in text


def test_every_link_into_docs_exists():
    for page in (README, *sorted((ROOT / "docs").glob("*.md"))):
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


def test_readme_links_to_every_docs_page():
    text = README.read_text()
    pages = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))
    assert pages and all(f"]({page})" in text for page in pages), pages


README_MAX_LINES = 150


def test_readme_is_a_front_door():
    """Short, with the detail in docs/ (every page linked, checked above)."""
    assert len(README.read_text().splitlines()) <= README_MAX_LINES


def _training_example() -> str:
    text = README.read_text()
    section = text[text.index("## Fine-tune with ExecuTorch's TrainingModule") :]
    (code,) = re.findall(r"```python\n(.*?)```", section.split("\n## ", 1)[0], flags=re.S)
    return code


def test_the_training_example_is_short_and_uses_the_public_api():
    code = _training_example()
    assert len(code.splitlines()) <= 20, code
    assert "lower_for_training(" in code and ".session(" in code and "state_dict()" in code


@pytest.mark.htp
def test_the_readme_training_example_runs_as_a_script(qnn_sdk, tmp_path):
    """The README's TrainingModule example, as a user would paste it: five finite
    losses, and the last below the first (it trains)."""
    script = tmp_path / "example.py"
    script.write_text(_training_example())
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=1200
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [line.split() for line in proc.stdout.splitlines() if line[:1].isdigit()]
    assert [int(s[0]) for s in steps] == list(range(5)), proc.stdout
    assert all(math.isfinite(float(s[1])) for s in steps), proc.stdout
    assert float(steps[-1][1]) < float(steps[0][1]), proc.stdout
