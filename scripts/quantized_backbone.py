"""Lower a pt2e-quantized CIFAR backbone under a float head for training and step it
beside torch: one Markdown row per configuration (docs/quantized.md).

    python scripts/quantized_backbone.py --modes split whole --dtypes 8a8w 16a8w --socs SM8650
"""

from __future__ import annotations

import argparse

from qnn_convbwd_dev import quantized_backbone as qb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=["split"], choices=qb.MODES)
    parser.add_argument("--dtypes", nargs="+", default=["8a8w"], choices=sorted(qb.DTYPES))
    parser.add_argument("--socs", nargs="+", default=["SM8650"])
    parser.add_argument("--fp32", action="store_true", help="HTP specs without use_fp16")
    parser.add_argument(
        "--train-head",
        action="store_true",
        help="the head in train() (dropout); torch draws its own masks",
    )
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for mode in args.modes:
        for dtype in args.dtypes:
            for soc in args.socs:
                measured = qb.measure(
                    mode,
                    dtype,
                    soc,
                    fp16=not args.fp32,
                    steps=args.steps,
                    train_head=args.train_head,
                )
                rows.append(qb.markdown_row(measured))
                print(rows[-1], flush=True)
    print(qb.MARKDOWN_HEAD)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
