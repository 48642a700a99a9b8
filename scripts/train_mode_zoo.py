"""A torchvision model in ``train()`` through TrainingSession, next to torch.

Lowers the joint graph of ``--arch`` in train mode (batch statistics, running
statistics updated every step) with ``--scheme``'s parameters trained and
cross-entropy, then runs ``--steps`` SGD steps through ``TrainingSession`` and
the same steps in torch eager fp32 and fp16 from the same weights. Prints, per
SoC: delegates, the ops kept on CPU by rule (and any backward op among them),
lowering time, step time, each step's loss against torch's with its bound
(``3e-2 * max(1, |loss|)`` or twice torch fp16's own deviation, whichever is
larger), and after every step the running statistics' worst relative L2 error
against torch fp32, next to torch fp16's own, with ``num_batches_tracked``.
A running statistic passes within ``1e-2`` or twice torch fp16's own error. A
running mean's error is taken relative to its channels' scale (the norm of the
running mean, or of the running standard deviation where that is larger): the
mean of a batch norm whose input is centred by construction (a convolution of a
batch norm's output, as in MobileNetV2's expansions) is ~1e-8 in fp32, and any
fp16 rounding is huge relative to that.

Torch fp16's gap on one input is one draw of a scalar: where it happens to be
small, the one-draw bound is tight for any fp16 computation, torch's own
included. ``--neighbours K`` lowers once and runs the steps on the input and
K - 1 copies moved by at most one fp16 rounding (``fidelity.neighbours``; the
labels unchanged), each through a fresh session from the module's initial
weights and buffers (checked), and torch fp32 and fp16 from the same weights.
Per step it prints, beside the input's one-draw verdict, the neighbourhood
verdict (``step_floor``): the median over the draws of the program's gap
within the bound built from the median of torch fp16's gaps, the same for the
running statistics (each draw's worst relative error), and the fraction of
ordered pairs of draws in which torch fp16's gap on one passes the one-draw
bound another's sets (how often a computation exactly as good as torch fp16
passes that bound). With K > 1 the final PASS or FAIL is the neighbourhood
verdict's, and the line says so beside the input's one-draw verdict.

Dropout draws different masks in torch and in the program, so for these
side-by-side steps the model's dropout modules are put in ``eval()``
(``--dropout`` keeps them: then the losses differ by the masks too). Dropout is
checked against torch with the program's own masks in ``tests/test_dropout.py``.

``--max-delegate-ops N`` lowers with the option of that name (delegates split into
pieces of at most N ops); the verdict then accepts more than one delegate.

    python scripts/train_mode_zoo.py --arch resnet18 --scheme full --soc SM8650 SM8850
    python scripts/train_mode_zoo.py --arch mobilenet_v2 --scheme bias-only --neighbours 5
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from torch import nn

import qnn_convbwd
from qnn_convbwd import finetune, training
from qnn_convbwd.toolchain import harness
from qnn_convbwd_dev import fidelity, step_floor, zoo


def _relative(ours: torch.Tensor, theirs: torch.Tensor, scale: torch.Tensor) -> float:
    return float((ours.float() - theirs).norm() / max(theirs.norm(), scale.norm(), 1e-12))


def _scale(name: str, buffers: dict) -> torch.Tensor:
    """What a buffer's error is relative to: for a running mean, also the running std."""
    if name.endswith("running_mean"):
        return buffers[name[: -len("mean")] + "var"].clamp_min(0).sqrt()
    return buffers[name]


def _torch_steps(net: nn.Module, x, y, args, dtype) -> tuple[list[float], list[dict]]:
    """Losses and buffers (fp32 copies) after each of torch's SGD steps in ``dtype``."""
    model = copy.deepcopy(net).to(dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=args.momentum)
    losses, buffers = [], []
    for _ in range(args.steps):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x.to(dtype)).float(), y)
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
        buffers.append(
            {
                name: b.detach().float() if b.dtype.is_floating_point else b.clone()
                for name, b in model.named_buffers()
            }
        )
    return losses, buffers


def _statistics(state: dict, reference: dict, half: dict) -> tuple[float, float, bool, list[str]]:
    """After one step: the worst relative error of the program's running statistics and of
    torch fp16's against torch fp32, whether ``num_batches_tracked`` is equal, and the
    buffers outside the one-draw bound."""
    worst = worst_half = 0.0
    counts, out = True, []
    for name, theirs in reference.items():
        if not theirs.dtype.is_floating_point:
            counts &= torch.equal(state[name], theirs)
            continue
        scale = _scale(name, reference)
        error = _relative(state[name], theirs, scale)
        error_half = _relative(half[name], theirs, scale)
        worst, worst_half = max(worst, error), max(worst_half, error_half)
        if error > step_floor.statistics_bound(error_half):
            out.append(name)
    return worst, worst_half, counts, out


def _series(values: list[float]) -> str:
    return " ".join(f"{v:.2e}" for v in values)


def run(args: argparse.Namespace, soc: str) -> bool:
    net, x, y = zoo.train_mode_batch(
        args.arch, args.scheme, args.batch, args.size, args.seed, dropout=args.dropout
    )
    program = training.lower_for_training(
        training.WithLoss(copy.deepcopy(net), nn.functional.cross_entropy),
        (x, y),
        harness.compile_specs(soc),
    )
    graph = program.edge.exported_program().graph
    delegates = sum("executorch_call_delegate" in str(n.target) for n in graph.nodes)
    rules: dict[str, int] = {}
    for op in program.report.on_cpu:
        rules[op.rule] = rules.get(op.rule, 0) + 1
    backward = [op.op for op in program.report.on_cpu if "backward" in op.op]

    # The input and its neighbours (--neighbours), each trained from the initial state
    # by a fresh session of the one program, and by torch from the same weights.
    draws = [moved for (moved,) in fidelity.neighbours((x,), args.neighbours, args.seed)]
    losses, seconds, states, reference, reference_buffers, half, half_buffers = (
        [] for _ in range(7)
    )
    initial = net.state_dict()
    restarts = True
    for moved in draws:
        session = program.session(args.lr, momentum=args.momentum)
        start = session.state_dict()
        restarts &= set(start) == set(initial) and all(
            torch.equal(value, initial[name].to(value.dtype)) for name, value in start.items()
        )
        draw_losses, draw_states = [], []
        for _ in range(args.steps):
            begin = time.perf_counter()
            draw_losses.append(session.step([moved, y]))
            seconds.append(time.perf_counter() - begin)
            draw_states.append(session.state_dict())
        session.close()
        losses.append(draw_losses)
        states.append(draw_states)
        for dtype, into, into_buffers in (
            (torch.float32, reference, reference_buffers),
            (torch.float16, half, half_buffers),
        ):
            draw_losses, draw_buffers = _torch_steps(net, moved, y, args, dtype)
            into.append(draw_losses)
            into_buffers.append(draw_buffers)

    dropout = "dropout on" if args.dropout else "dropout modules in eval()"
    print(f"\n{args.arch} {args.scheme} train() ({dropout}) batch {args.batch} {args.size}px {soc}")
    print(f"  delegates {delegates}; ops on CPU by rule {rules}; backward ops on CPU {backward}")
    print(
        f"  lowering {program.lowering_seconds:.1f} s; "
        f"step {sum(seconds) / len(seconds):.2f} s (simulator)"
    )
    # One delegate unless --max-delegate-ops split it on purpose.
    ok = (delegates == 1 or args.max_delegate_ops is not None) and not backward
    if len(draws) > 1:
        print(
            f"  {len(draws)} draws (the input and {len(draws) - 1} neighbours), each from the "
            f"initial state: every session started from the module's weights and buffers "
            f"{restarts}"
        )
        ok &= restarts
    one_draw = neighbourhood = True
    for index in range(args.steps):
        ours, theirs, fp16 = losses[0][index], reference[0][index], half[0][index]
        bound = step_floor.loss_bound(theirs, fp16 - theirs)
        within = abs(ours - theirs) <= bound
        one_draw &= within
        print(
            f"  step {index}: loss {ours:.5f} torch {theirs:.5f} fp16 {fp16:.5f} "
            f"gap {abs(ours - theirs):.2e} bound {bound:.2e} {'ok' if within else 'OUT'}"
        )
        if len(draws) > 1:
            column = [[draw[index] for draw in series] for series in (losses, reference, half)]
            verdict = step_floor.loss_verdict(*column)
            neighbourhood &= verdict.within
            print(
                f"    over the draws: median gap {verdict.error:.2e} (torch fp16 "
                f"{verdict.floor:.2e}) bound {verdict.bound:.2e} "
                f"{'ok' if verdict.within else 'OUT'}; torch fp16 passes the one-draw bound "
                f"in {step_floor.fp16_pass_fraction(column[1], column[2]):.0%} of pairs"
            )
            gaps = [[abs(v - r) for v, r in zip(series, column[1])] for series in column]
            print(f"    gaps per draw: ours {_series(gaps[0])}; torch fp16 {_series(gaps[2])}")
    for index in range(args.steps):
        judged = [
            _statistics(states[k][index], reference_buffers[k][index], half_buffers[k][index])
            for k in range(len(draws))
        ]
        worst, worst_half, counts, out = judged[0]
        one_draw &= not out
        ok &= all(j[2] for j in judged)
        print(
            f"  step {index}: running statistics worst relative L2 {worst:.2e} "
            f"(torch fp16 {worst_half:.2e}); num_batches_tracked equal {counts}"
            + (f"; OUT {out}" if out else "")
        )
        if len(draws) > 1:
            verdict = step_floor.statistics_verdict([j[0] for j in judged], [j[1] for j in judged])
            neighbourhood &= verdict.within
            print(
                f"    over the draws: median worst {verdict.error:.2e} (torch fp16 "
                f"{verdict.floor:.2e}) bound {verdict.bound:.2e} "
                f"{'ok' if verdict.within else 'OUT'}; num_batches_tracked equal in every "
                f"draw {all(j[2] for j in judged)}"
            )
    if len(draws) > 1:
        ok &= neighbourhood
        print(
            f"  {'PASS' if ok else 'FAIL'} by the neighbourhood verdict (medians over "
            f"{len(draws)} draws); the input's one-draw verdict: "
            f"{'within' if one_draw else 'OUT'}"
        )
    else:
        ok &= one_draw
        print(f"  {'PASS' if ok else 'FAIL'}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--scheme", default="full", choices=finetune.SCHEMES)
    parser.add_argument("--soc", nargs="+", default=["SM8650"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--momentum", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dropout", action="store_true", help="keep dropout in train mode")
    parser.add_argument(
        "--neighbours",
        type=int,
        default=1,
        help="judge over the input and K - 1 copies moved by at most one fp16 rounding "
        "(fidelity.neighbours), each trained from the initial state; the input's one-draw "
        "verdict is printed too",
    )
    parser.add_argument(
        "--max-delegate-ops", type=int, help="split delegates (the option of that name)"
    )
    args = parser.parse_args()
    qnn_convbwd.enable(max_delegate_ops=args.max_delegate_ops)
    results = [run(args, soc) for soc in args.soc]
    return 0 if all(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
