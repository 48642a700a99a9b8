"""Which ops of torchvision's classifiers stay on CPU in ``train()`` (``qnn_convbwd_dev.sweep``).

By default ``qnn_convbwd.decide`` (nothing compiled); ``--lower`` lowers each model
(minutes to hours for the large ones) and ``--steps N`` takes N SGD steps on the
simulator through ``TrainingSession`` next to torch's fp32 and fp16 steps. Writes
``--out``.md and ``--out``.json and prints the table. ``--noise K`` lowers nothing:
per model, torch's losses over ``--steps`` steps (2 without it) on the batch and
K - 1 neighbours moved by one fp16 rounding, how far they spread and the bounds
(``sweep.step_noise``), written to ``--out``.md.

    python scripts/zoo_sweep.py --out /tmp/zoo_sweep
    python scripts/zoo_sweep.py --arch resnet18 --lower --steps 2 --out /tmp/resnet18
    python scripts/zoo_sweep.py --arch googlenet --noise 16 --out /tmp/googlenet_noise
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from qnn_convbwd_dev import sweep


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", nargs="+", default=list(sweep.MODELS))
    parser.add_argument("--scheme", nargs="+", default=["full"], choices=sweep.SCHEMES)
    parser.add_argument("--soc", default="SM8650")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument(
        "--size", type=int, help="input size (default: 32, or the model's smallest above)"
    )
    parser.add_argument("--lower", action="store_true", help="lower each model for real")
    parser.add_argument(
        "--steps", type=int, default=0, help="with --lower: SGD steps on the simulator"
    )
    parser.add_argument("--lr", type=float, default=0.01, help="the SGD steps' learning rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--noise",
        type=int,
        metavar="K",
        help="torch only: the steps' losses over the batch and K - 1 fp16 neighbours",
    )
    parser.add_argument("--out", required=True, help="path without suffix for .md and .json")
    args = parser.parse_args()
    if args.steps and not args.lower and args.noise is None:
        parser.error("--steps needs --lower (or --noise)")
    if args.noise is not None and args.lower:
        parser.error("--noise lowers nothing: without --lower")
    logging.basicConfig(level=logging.WARNING)
    if args.noise is not None:
        return _noise(args)
    done = []

    def on_row(row: sweep.Row) -> None:
        done.append(row)
        sweep.write(done, args.out)  # what is done so far survives an interrupted sweep
        print(sweep.markdown([row]).splitlines()[-1], flush=True)

    rows = sweep.sweep(
        args.arch,
        args.scheme,
        on_row=on_row,
        soc=args.soc,
        batch=args.batch,
        size=args.size,
        lower=args.lower,
        steps=args.steps,
        lr=args.lr,
        seed=args.seed,
    )
    md, js = sweep.write(rows, args.out)
    print(sweep.markdown(rows))
    print(f"written: {md} {js}")
    return 0 if all(r.error is None for r in rows) else 1


def _noise(args: argparse.Namespace) -> int:
    tables = []
    for arch in args.arch:
        for scheme in args.scheme:
            size = sweep.smallest_size(arch) if args.size is None else args.size
            net, x, y = sweep.train_mode_batch(
                arch, scheme, args.batch, size, args.seed, stochastic_depth=False
            )
            rows = sweep.step_noise(
                net, x, y, steps=args.steps or 2, lr=args.lr, draws=args.noise, seed=args.seed
            )
            tables.append(
                sweep.noise_markdown(f"{arch} {scheme}, batch {args.batch}, {size} px", rows)
            )
            print(tables[-1] + "\n", flush=True)
    out = Path(args.out).with_suffix(".md")
    out.write_text("\n\n".join(tables) + "\n")
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
