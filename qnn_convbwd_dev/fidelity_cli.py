"""``qnn-convbwd fidelity``: lower one training graph, run it on the simulator, judge it.

Prints ``fidelity.Report.to_markdown()`` (the HTP beside torch's fp16 step);
exits 0 when every tensor is within fidelity, 1 otherwise. With ``--neighbours
K`` the program also runs on K - 1 copies of the input moved by at most one fp16
rounding (``fidelity.neighbours``), the table is pooled over the K (rms), and the
verdict needs the rms and the median pooling both within; the input's own
verdict is printed too.

``--canary [NAME ...]`` measures the fidelity canaries (``canary.CANARIES``, all
when no name is given) instead of ``--graph``: each zoo step is lowered (through
the lowering cache), run on the simulator and printed against the record beside
the canary module, tensor by tensor; it exits 1 when any does not match the
record. ``--record`` then writes the measurements into the record.
"""

from __future__ import annotations

import argparse

from qnn_convbwd import options

GRAPHS = ("bn-bias", "bn-affine", "small-loss", "demo", "mobilenet", "resnet", "linear")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--graph", choices=GRAPHS, default="bn-bias", help="training graph")
    parser.add_argument("--soc", default="SM8650", help="e.g. SM8450, SM8550, SM8650, SM8850")
    parser.add_argument("--loss-scale", type=float, default=1.0, help="options.loss_scale")
    parser.add_argument(
        "--batch-norm", choices=options.BATCH_NORM_MODES, default="fold", help="lowering"
    )
    parser.add_argument(
        "--neighbours",
        type=int,
        default=1,
        metavar="K",
        help="judge over the input and K - 1 copies moved by one fp16 rounding",
    )
    parser.add_argument(
        "--canary",
        nargs="*",
        metavar="NAME",
        help="measure the fidelity canaries (all when no name is given) against their record",
    )
    parser.add_argument(
        "--record", action="store_true", help="with --canary: write the measurements as the record"
    )
    parser.add_argument(
        "--no-cache", action="store_true", help="with --canary: lower without the lowering cache"
    )


def _graph(name: str):
    from . import models
    from . import numerics_models as nm

    if name.startswith("bn-"):
        g = nm.bn_training_graph(train=name[3:])
    elif name == "small-loss":
        g = nm.small_loss_graph()
    else:
        g = models.training_graph(name, size=15, trainable_backbone=True)
    return g.model, g.inputs, g.program


def _canaries(args: argparse.Namespace) -> int:
    from . import canary

    try:
        chosen = [canary.by_name(n) for n in args.canary] or list(canary.CANARIES)
    except KeyError as err:
        raise SystemExit(str(err)) from None
    record = canary.load()
    measured = {}
    failed = False
    for c in chosen:
        measured[c.name] = canary.measure(c, cache=not args.no_cache)
        print(canary.table(c.name, record.get(c.name), measured[c.name]), flush=True)
        print()
        failed |= bool(canary.compare(record.get(c.name), measured[c.name]))
    if args.record:
        canary.save({**canary.load(), **measured})  # read again: another run may have recorded
        print(f"recorded {len(measured)} canaries in {canary.RECORD}")
        return 0
    return 1 if failed else 0


def run(args: argparse.Namespace) -> int:
    if args.canary is not None:
        return _canaries(args)
    if args.record:
        raise SystemExit("--record goes with --canary")
    from qnn_convbwd import api
    from qnn_convbwd.toolchain import harness

    from . import fidelity

    model, inputs, program = _graph(args.graph)
    with api.enabled(loss_scale=args.loss_scale, batch_norm=args.batch_norm):
        compiled = harness.lower_program(program, args.soc)
    if args.neighbours < 1:
        raise SystemExit(f"--neighbours must be at least 1, got {args.neighbours}")
    reports = [
        fidelity.assess_model(model, moved, program, compiled.run(list(moved)), args.loss_scale)
        for moved in fidelity.neighbours(inputs, args.neighbours)
    ]
    print(
        f"{args.graph} on {args.soc} (loss_scale={args.loss_scale:g}, "
        f"batch_norm={args.batch_norm}, {harness.delegate_count(compiled.edge)} delegate(s))"
    )
    if len(reports) == 1:
        print(reports[0].to_markdown())
        return 0 if reports[0].within else 1
    print(f"pooled (rms) over the input and {len(reports) - 1} neighbours:")
    print(fidelity.pooled(reports).to_markdown())
    within, lines = fidelity.neighbourhood_summary(reports)
    print("\n".join(lines))
    return 0 if within else 1
