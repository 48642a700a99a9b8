"""The README and docs/ stay in step with the code."""

from __future__ import annotations

import re
from pathlib import Path

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
