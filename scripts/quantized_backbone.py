"""Lower a pt2e-quantized backbone under a float head for training and step it beside
torch: one Markdown row per configuration (docs/quantized.md).

    python scripts/quantized_backbone.py --models cifar resnet18 mobilenet_v2 \
        --modes split --dtypes 8a8w 16a8w --socs SM8650 --compare-float
"""

from __future__ import annotations

import argparse
import json
import logging
import traceback

from qnn_convbwd_dev import quantized_backbone as qb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["cifar"], choices=qb.MODELS)
    parser.add_argument("--modes", nargs="+", default=["split"], choices=qb.MODES)
    parser.add_argument("--dtypes", nargs="+", default=["8a8w"], choices=sorted(qb.DTYPES))
    parser.add_argument("--socs", nargs="+", default=["SM8650"])
    parser.add_argument("--fp32", action="store_true", help="HTP specs without use_fp16")
    parser.add_argument(
        "--train-head",
        action="store_true",
        help="the head in train() (dropout); torch draws its own masks",
    )
    parser.add_argument(
        "--compare-float",
        action="store_true",
        help="also lower the same model unquantized for its static and context bytes",
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", help="append each measurement as a JSON line to this file")
    parser.add_argument(
        "--forward",
        nargs="*",
        type=int,
        metavar="BLOCKS",
        help="instead: the backbone's first BLOCKS blocks (all without a number) lowered "
        "alone for inference, their output against torch's converted model, the same with "
        "each convolution's ReLU fused, and torch's converted against the float blocks",
    )
    parser.add_argument(
        "--torch-only",
        action="store_true",
        help="with --forward: torch's converted blocks against the float blocks, not lowered",
    )
    parser.add_argument(
        "--trained",
        action="store_true",
        help="the model trained on the digits (quantized_backbone.trained_model), "
        "calibrated on the digits' training split and run on its test split",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.torch_only and args.forward is None:
        parser.error("--torch-only goes with --forward")
    if args.forward is not None and args.torch_only:
        print("| model | weights | quantization | blocks | torch vs float |\n|---|---|---|---|---|")
        for arch in args.models:
            for dtype in args.dtypes:
                for blocks in args.forward or [None]:
                    error = qb.quantization_error(arch, dtype, blocks, args.trained)
                    weights = "trained on digits" if args.trained else "random"
                    print(f"| {arch} | {weights} | {dtype} | {blocks or 'all'} | {error:.2e} |")
        return
    if args.forward is not None:
        print("| model | quantization | blocks | program vs torch | program vs fused | "
              "torch vs float | program vs float |\n|---|---|---|---|---|---|---|")  # fmt: skip
        for arch in args.models:
            for dtype in args.dtypes:
                for blocks in args.forward or [None]:
                    g = qb.forward_gap(arch, dtype, blocks, args.trained)
                    print(
                        f"| {g.arch} | {g.dtype} | {g.blocks} | {g.program_vs_torch:.2e} | "
                        f"{g.program_vs_fused:.2e} | {g.torch_vs_float:.2e} | "
                        f"{g.program_vs_float:.2e} |",
                        flush=True,
                    )
        return
    rows = []
    for arch in args.models:
        for mode in args.modes:
            for dtype in args.dtypes:
                for soc in args.socs:
                    try:
                        measured = qb.measure(
                            arch,
                            mode,
                            dtype,
                            soc,
                            fp16=not args.fp32,
                            steps=args.steps,
                            train_head=args.train_head,
                            compare_float=args.compare_float,
                            trained=args.trained,
                        )
                    except Exception:  # one configuration failing does not stop the others
                        print(f"{arch} {mode} {dtype} {soc}: failed", flush=True)
                        traceback.print_exc()
                        continue
                    rows.append(qb.markdown_row(measured))
                    print(rows[-1], flush=True)
                    print(f"  within 3e-2 x max(1, |loss|): {measured.within_bound}")
                    print(f"  torch's losses: {measured.losses}")
                    print(f"  quantized vs float loss: {measured.quantization_loss_gap}")
                    print(f"  QNN ops: {measured.qnn_ops}")
                    for detail in measured.on_cpu_details:
                        print(f"  on CPU: {detail}")
                    if args.json:
                        with open(args.json, "a") as file:
                            file.write(json.dumps(measured.__dict__) + "\n")
    print(qb.MARKDOWN_HEAD)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
