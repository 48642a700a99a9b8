"""Fine-tune a quantized backbone's head, or adapters inside it and the head, on shifted
digits on the simulator, beside torch, and print the accuracies (docs/quantized.md).

    python scripts/quantized_domain_shift.py --shift invert --scheme adapter --epochs 1
"""

from __future__ import annotations

import argparse
import logging

from qnn_convbwd import finetune
from qnn_convbwd_dev import quantized_domain_shift as ds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shift", choices=ds.SHIFTS, default="invert")
    parser.add_argument("--quantize", choices=["8a8w", "16a8w"], default="8a8w")
    parser.add_argument(
        "--scheme", choices=finetune.QUANTIZED_SCHEMES, default=finetune.QUANTIZED_SCHEME
    )
    parser.add_argument("--soc", default="SM8650")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int)
    length.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--pretrain-epochs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    found = ds.run(
        args.shift,
        args.quantize,
        args.scheme,
        args.soc,
        steps=args.steps,
        epochs=args.epochs,
        batch=args.batch,
        lr=args.lr,
        pretrain_epochs=args.pretrain_epochs,
        seed=args.seed,
    )
    for line in ds.lines(found):
        print(line)


if __name__ == "__main__":
    main()
