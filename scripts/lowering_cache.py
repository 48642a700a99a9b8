#!/usr/bin/env python3
"""Lower one torchvision training graph and report where the time went, with the
compiled-context cache on: run it twice in fresh processes with the same
``--cache-dir`` to measure a first lowering (QAIRT finalises every delegate) against
a second one (the whole lowering from the cache; with ``--contexts-only``, the
cache of whole lowerings off, every context binary from the cache).

Prints one line: the wall time of ``qnn_convbwd.lower``, the time of each phase
(from ``qnn_convbwd.progress``), how many delegates were finalised and how many
were cache hits, and the program's bytes.

    PYTHONPATH=. python scripts/lowering_cache.py --arch resnet18 --scheme last_layers \\
        --size 32 --batch 2 --soc SM8650 --cache-dir /tmp/contexts
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

import torch

import qnn_convbwd
from qnn_convbwd import progress
from qnn_convbwd.toolchain import harness


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--scheme", default="last_layers")
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--soc", default="SM8650")
    parser.add_argument("--cache-dir", required=True)
    parser.add_argument("--max-delegate-ops", type=int, default=None)
    parser.add_argument(
        "--contexts-only",
        action="store_true",
        help="only the context binaries from the cache (lowering_cache=False)",
    )
    args = parser.parse_args()

    from qnn_convbwd_dev import zoo

    model, inputs = zoo.step(args.arch, args.scheme, args.size)
    generator = torch.Generator().manual_seed(0)
    inputs = tuple(torch.randn((args.batch, *t.shape[1:]), generator=generator) for t in inputs)
    from torch.export.experimental import _export_forward_backward

    joint = _export_forward_backward(torch.export.export(model, inputs, strict=True))

    events: list[progress.Event] = []
    options = {
        "context_cache_dir": args.cache_dir,
        "max_delegate_ops": args.max_delegate_ops,
        "lowering_cache": not args.contexts_only,
    }
    with qnn_convbwd.enabled(**options), progress.observe(events.append):
        start = time.perf_counter()
        result = qnn_convbwd.lower(joint, harness.compile_specs(args.soc))
        seconds = time.perf_counter() - start
        pte = result.edge.to_executorch().buffer

    phases: dict[str, float] = {}
    for event, following in zip(events, events[1:]):
        phases[event.phase] = phases.get(event.phase, 0.0) + following.elapsed - event.elapsed
    record = {
        "graph": f"{args.arch}/{args.scheme} {args.size}px batch {args.batch} {args.soc}",
        "lower_s": round(seconds, 2),
        "phases_s": {k: round(v, 2) for k, v in phases.items()},
        "finalized": sum(e.phase == progress.FINALIZE for e in events),
        "cache_hits": sum(e.phase == progress.CACHE_HIT for e in events),
        "pte_bytes": len(pte),
        "pte_sha256": hashlib.sha256(pte).hexdigest()[:16],
    }
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
