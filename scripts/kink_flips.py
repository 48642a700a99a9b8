"""Gate inputs of a torchvision model's training step that sit on a kink, and what a flip does.

The zoo graph's model and input (``zoo.step``: ``zoo.graph``'s, not exported;
calibrated random weights, the parameters SCHEME trains, MSE), run in fp32 and
in torch fp16 on CPU by
``qnn_convbwd_dev.kinks.find``; nothing is lowered. Prints the flips nearest
the fidelity bound (one element crossing a ReLU / ReLU6 / Hardsigmoid /
Hardswish kink, the gradient it moves and by how much, against torch fp16's
own error on that gradient), then every gate with an element within WITHIN x
its fp16 noise of a kink. A flip marked "alone outside" puts its tensor past
the bound whenever the HTP and torch fp16 round that element to different
sides: the graph's step is ill-conditioned there (docs/zoo.md, 96 px).

    PYTHONPATH=. python scripts/kink_flips.py mobilenet_v3_small [--scheme bias_only]
        [--size 96] [--top 12] [--within 3]

Exits 1 when some flip is decisive alone, else 0.
"""

from __future__ import annotations

import argparse
import sys

from qnn_convbwd_dev import kinks, zoo


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("arch")
    parser.add_argument("--scheme", default="bias_only", choices=zoo.SCHEMES[:3])
    parser.add_argument("--size", type=int, default=32, help="input size, px")
    parser.add_argument("--top", type=int, default=12, help="flips printed")
    parser.add_argument(
        "--within", type=float, default=3.0, help="near a kink: within this many x fp16 noise"
    )
    args = parser.parse_args()
    model, inputs = zoo.step(args.arch, args.scheme, args.size)
    summaries, flips = kinks.find(model, inputs, top=args.top, within=args.within)
    decisive = sum(f.decisive for f in flips)
    print(
        f"{args.arch}/{args.scheme} {args.size} px: {len(summaries)} gate calls, "
        f"{sum(s.near for s in summaries)} elements near a kink, "
        f"{sum(s.flipped_fp16 for s in summaries)} flipped by torch fp16; "
        f"{decisive} of the {len(flips)} flips below decisive alone"
    )
    print(kinks.to_markdown(summaries, flips))
    return 1 if decisive else 0


if __name__ == "__main__":
    sys.exit(main())
