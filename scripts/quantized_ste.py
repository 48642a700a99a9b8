"""Lower trainable adapters on a pt2e-quantized frozen backbone (the straight-through
estimator) for training and step them beside torch: one Markdown row per configuration
(docs/quantized.md).

    python scripts/quantized_ste.py --models cifar resnet18 --dtypes 8a8w --socs SM8650

``cifar``: ExecuTorch's CIFAR model with the adapters of ``--adapters``; ``cifar_qat``:
its quantization-aware-trained features behind an input adapter; ``resnet18``,
``mobilenet_v2``: the backbone quantized under its float head, behind an input adapter
(``--head``: the head trains too). ``--trained`` (with ``--adapters inside``): the
torchvision model trained on scikit-learn's digits (cached), calibrated, stepped and
compared on digits batches.
"""

from __future__ import annotations

import argparse

from qnn_convbwd_dev import quantized_backbone as qb
from qnn_convbwd_dev import quantized_ste as qs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["cifar"])
    parser.add_argument(
        "--adapters",
        nargs="+",
        default=list(qs.ADAPTERS),
        choices=[*qs.ADAPTERS, qs.INSIDE],
        help="cifar: input and/or between; resnet18, mobilenet_v2: inside (the finetune "
        "adapter scheme's residual adapters, float in the quantized backbone), else an "
        "input adapter",
    )
    parser.add_argument("--dtypes", nargs="+", default=["8a8w"], choices=sorted(qb.DTYPES))
    parser.add_argument("--socs", nargs="+", default=["SM8650"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--head", action="store_true", help="the torchvision models' float head trains too"
    )
    parser.add_argument("--lr", type=float, help="SGD rate (default: the model's)")
    parser.add_argument(
        "--trained",
        action="store_true",
        help="with --adapters inside: the model trained on the digits "
        "(quantized_backbone.trained_model), calibrated and stepped on digits batches",
    )
    parser.add_argument(
        "--rounding",
        action="store_true",
        help="torch only: the reference against the same with each activation rounded once",
    )
    args = parser.parse_args()
    if args.rounding:
        for model in args.models:
            for dtype in args.dtypes:
                built, _ = qs.build(model, dtype, tuple(args.adapters), args.head, args.trained)
                lr = args.lr if args.lr is not None else qb.LR.get(model, qb.LR["cifar"])
                found = qs.rounding_deviation(built, args.steps, lr, args.trained)
                print(
                    f"{model} {dtype}: losses {found.losses[0]} (unfused) vs {found.losses[1]} "
                    f"(fused), gaps {', '.join(f'{g:.1e}' for g in found.loss_gaps)}; gradient "
                    "cosine / norm ratio "
                    + ", ".join(f"{n} {c:.3f} / {r:.2f}" for n, (c, r) in found.gradients.items()),
                    flush=True,
                )
        return
    print(qs.MARKDOWN_HEAD, flush=True)
    for model in args.models:
        for dtype in args.dtypes:
            for soc in args.socs:
                measured = qs.measure(
                    tuple(args.adapters),
                    dtype,
                    soc,
                    steps=args.steps,
                    lr=args.lr,
                    model_name=model,
                    head=args.head,
                    trained=args.trained,
                )
                print(qs.markdown_row(measured), flush=True)


if __name__ == "__main__":
    main()
