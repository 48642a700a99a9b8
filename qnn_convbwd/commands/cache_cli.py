"""``qnn-convbwd cache``: list or clear the cache of context binaries and whole lowerings
(context_cache.py, lowering_cache.py)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from .. import context_cache, lowering_cache


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "action", choices=("list", "clear"), help="list the entries, or delete them all"
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help=f"cache directory (default: {context_cache.default_dir()})",
    )


def _size(count: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if count < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.2f} GiB"


def _age(seconds: float) -> str:
    for unit, span in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= span:
            return f"{seconds / span:.1f} {unit}"
    return f"{seconds:.0f} s"


def run(args: argparse.Namespace) -> int:
    root = args.dir or context_cache.default_dir()
    if args.action == "clear":
        print(f"deleted {context_cache.clear(root)} entries from {root}")
        return 0
    entries = context_cache.entries(root)
    now = time.time()
    print(f"{root}: {len(entries)} entries, {_size(sum(e.size for e in entries))}")
    if entries:
        print(
            f"{'key':16}  {'size':>10}  {'age':>8}  {'last used':>9}  {'kind':8}  soc     "
            "ops  holds"
        )
    for entry in reversed(entries):  # most recently used first
        about = entry.about
        if about.get("kind") == lowering_cache.KIND:
            kind, holds = "lowering", f"{about.get('delegates', '?')} delegate(s)"
        else:
            kind, holds = "context", ",".join(about.get("graphs", ())) or "?"
        print(
            f"{entry.key[:16]}  {_size(entry.size):>10}  {_age(now - entry.created):>8}  "
            f"{_age(now - entry.last_used):>9}  {kind:8}  {about.get('soc', '?'):6}  "
            f"{about.get('ops', '?'):>4}  {holds}"
        )
    return 0
