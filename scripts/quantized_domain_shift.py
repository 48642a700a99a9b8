"""Fine-tune a quantized backbone's head, or adapters inside it and the head, on shifted
digits on the simulator, beside torch, and print the accuracies (docs/quantized.md).

    python scripts/quantized_domain_shift.py --shift invert --scheme adapter --epochs 1

The learning rates, momenta and the adapters' warm start of the head alone default to
the scheme's protocol (``quantized_domain_shift.PROTOCOLS``); each option overrides its
part. ``--torch-spread 0 1 2`` lowers nothing: torch alone, per seed, on the shifted
images as they are and moved one fp32 ulp up.
"""

from __future__ import annotations

import argparse
import dataclasses
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
    parser.add_argument(
        "--cpu-only", action="store_true", help="lower for SM8350: nothing delegated"
    )
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, help="of the scheme (after any warm start)")
    length.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, help="the scheme's SGD rate")
    parser.add_argument("--momentum", type=float, help="the scheme's SGD momentum")
    parser.add_argument(
        "--head-epochs", type=int, help="epochs of the head alone first (adapter: 1)"
    )
    parser.add_argument("--head-lr", type=float, help="the head-alone epochs' rate")
    parser.add_argument("--head-momentum", type=float, help="the head-alone epochs' momentum")
    parser.add_argument("--pretrain-epochs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--torch-spread",
        type=int,
        nargs="+",
        metavar="SEED",
        help="no program: torch alone for these seeds, on the shifted images as they are "
        "and moved one fp32 ulp up (how much the outcome depends on rounding)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    chosen = {
        field.name: getattr(args, field.name)
        for field in dataclasses.fields(ds.Protocol)
        if getattr(args, field.name) is not None
    }
    protocol = dataclasses.replace(ds.PROTOCOLS[args.scheme], **chosen)
    if args.torch_spread:
        for seed, as_is, nudged in ds.torch_spread(
            args.shift,
            args.scheme,
            protocol,
            tuple(args.torch_spread),
            steps=args.steps,
            epochs=args.epochs,
            batch=args.batch,
            pretrain_epochs=args.pretrain_epochs,
        ):
            print(
                f"seed {seed}: torch {100 * as_is:.1f}%, one ulp up {100 * nudged:.1f}% "
                f"({100 * abs(as_is - nudged):.1f} points apart)"
            )
        return
    found = ds.run(
        args.shift,
        args.quantize,
        args.scheme,
        args.soc,
        steps=args.steps,
        epochs=args.epochs,
        batch=args.batch,
        protocol=protocol,
        pretrain_epochs=args.pretrain_epochs,
        seed=args.seed,
        cpu_only=args.cpu_only,
    )
    for line in ds.lines(found):
        print(line)


if __name__ == "__main__":
    main()
