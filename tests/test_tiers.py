"""tests/tiers.py: every long check it names is a test, collected as named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tiers import LONG

ROOT = Path(__file__).resolve().parent.parent


def test_every_long_entry_names_a_collected_test(request):
    # A run of the whole suite has collected them all (each xdist worker collects every
    # test); otherwise a collection of the files they name, in another process, decides.
    in_this_run = {item.nodeid for item in request.session.items}
    if set(LONG) <= in_this_run:
        return
    files = sorted({nodeid.split("::")[0] for nodeid in LONG})
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", *files],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    collected = {line.strip() for line in listed.stdout.splitlines() if "::" in line}
    assert collected, listed.stdout + listed.stderr
    missing = sorted(set(LONG) - collected)
    assert not missing, f"tests/tiers.py LONG names tests that are not collected: {missing}"


def test_each_long_entry_says_why():
    assert all(isinstance(why, str) and len(why) > 20 for why in LONG.values())
