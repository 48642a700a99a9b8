"""Every relative link in README.md and docs/ resolves, anchors included, and the pages
describe the software without work-log references (session or issue numbers).

Anchors follow GitHub's heading slugs: the heading's rendered text lower-cased, every
character that is not a letter, digit, space, hyphen or underscore dropped, spaces
turned into hyphens, and a repeated slug suffixed ``-1``, ``-2``, ...
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")))

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_INLINE_CODE = re.compile(r"`[^`]*`")
# A work-log reference: the word session or issue (or their plurals) before a number, an
# S-number tag, a hash before a number. Code spans are left out (a gate named ``relu#1``
# is not a work-log reference).
WORK_LOG = re.compile(
    r"[Ss]essions? [0-9]|\bS[0-9]{1,2}\b|[Ii]ssues? #?[0-9]|(?<![\w`])#[0-9]{1,3}\b"
)


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of a Markdown text outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's Markdown text (before de-duplication)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a page's headings define, duplicates numbered as GitHub does."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(text):
        match = _HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    found.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", text))
    return found


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every link in a page's prose."""
    found = []
    for number, line in prose_lines(text):
        for target in _LINK.findall(_INLINE_CODE.sub("", line)):
            found.append((number, target))
    return found


def broken(page: Path, target: str) -> str | None:
    """Why a relative link from ``page`` does not resolve, or None when it does."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):
        return None  # http(s), mailto: not checked here
    path, _, anchor = target.partition("#")
    dest = (page.parent / unquote(path)).resolve() if path else page
    if not dest.exists():
        return f"no file {path}"
    if anchor and dest.suffix == ".md" and unquote(anchor) not in anchors(dest.read_text()):
        return f"no heading #{anchor} in {path or page.name}"
    return None


def test_slug_follows_githubs_rules():
    assert slug("Where every graph stands") == "where-every-graph-stands"
    assert slug("The HTP shim (`qnn_convbwd/toolchain/htp_shim.c`)") == (
        "the-htp-shim-qnn_convbwdtoolchainhtp_shimc"
    )
    assert slug("Folded on the device, `W * s` (trained weights)") == (
        "folded-on-the-device-w--s-trained-weights"
    )
    assert slug("See [numerics](numerics.md): batch norm") == "see-numerics-batch-norm"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n## A\n") == {"a", "a-1", "a-2"}


def test_a_broken_link_or_anchor_is_reported(tmp_path):
    page = tmp_path / "page.md"
    other = tmp_path / "other.md"
    other.write_text("# Other page\n\n## The `stride` option\n")
    page.write_text("x")
    assert broken(page, "other.md") is None
    assert broken(page, "other.md#the-stride-option") is None
    assert broken(page, "other.md#the-stride-option-session-4") == (
        "no heading #the-stride-option-session-4 in other.md"
    )
    assert broken(page, "#nowhere") == "no heading #nowhere in page.md"
    assert broken(page, "missing.md") == "no file missing.md"
    assert broken(page, "https://example.com/x#y") is None


def test_links_skip_code():
    text = "see [a](a.md) and `[b](b.md)`\n```\n[c](c.md)\n```\n[d](d.md#x)\n"
    assert links(text) == [(1, "a.md"), (5, "d.md#x")]


def test_the_work_log_pattern_finds_references():
    n = 7  # any number: the examples are built, so this file names no real reference
    found = (
        f"as in session {n}",
        f"sessions {n}-{n + 6}",
        f"(S{n})",
        f"issue {n}",
        f"issues {n}, {n + 1}",
    )
    for text in (*found, f"#{n}"):
        assert WORK_LOG.search(text), text
    for text in ("TrainingSession", "SM8650", "a `relu#1` gate", "V75", "issued"):
        assert not WORK_LOG.search(text), text


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    bad = [
        f"{page.relative_to(ROOT)}:{number}: {target}: {reason}"
        for number, target in links(page.read_text())
        if (reason := broken(page, target))
    ]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_session_or_issue_references(page):
    found = [
        f"{page.relative_to(ROOT)}:{number}: {line.strip()}"
        for number, line in prose_lines(page.read_text())
        if WORK_LOG.search(_INLINE_CODE.sub("", line))
    ]
    assert not found, "\n".join(found)
