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

Dropout draws different masks in torch and in the program, so for these
side-by-side steps the model's dropout modules are put in ``eval()``
(``--dropout`` keeps them: then the losses differ by the masks too). Dropout is
checked against torch with the program's own masks in ``tests/test_dropout.py``.

    python scripts/train_mode_zoo.py --arch resnet18 --scheme full --soc SM8650 SM8850
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


def run(args: argparse.Namespace, soc: str) -> bool:
    net = finetune.architecture(args.arch, classes=10, seed=args.seed).train()
    net = finetune.apply_scheme(net, args.scheme, size=args.size)
    if not args.dropout:
        for module in net.modules():
            if isinstance(module, nn.modules.dropout._DropoutNd):
                module.eval()
    generator = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.batch, 3, args.size, args.size, generator=generator)
    y = torch.randint(0, 10, (args.batch,), generator=generator)
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

    session = program.session(args.lr, momentum=args.momentum)
    losses, seconds, states = [], [], []
    for _ in range(args.steps):
        begin = time.perf_counter()
        losses.append(session.step([x, y]))
        seconds.append(time.perf_counter() - begin)
        states.append(session.state_dict())
    session.close()
    reference, reference_buffers = _torch_steps(net, x, y, args, torch.float32)
    half, half_buffers = _torch_steps(net, x, y, args, torch.float16)

    dropout = "dropout on" if args.dropout else "dropout modules in eval()"
    print(f"\n{args.arch} {args.scheme} train() ({dropout}) batch {args.batch} {args.size}px {soc}")
    print(f"  delegates {delegates}; ops on CPU by rule {rules}; backward ops on CPU {backward}")
    print(
        f"  lowering {program.lowering_seconds:.1f} s; "
        f"step {sum(seconds) / len(seconds):.2f} s (simulator)"
    )
    ok = delegates == 1 and not backward
    for index, (ours, theirs, fp16) in enumerate(zip(losses, reference, half)):
        bound = max(3e-2 * max(1.0, abs(theirs)), 2 * abs(fp16 - theirs))
        within = abs(ours - theirs) <= bound
        ok &= within
        print(
            f"  step {index}: loss {ours:.5f} torch {theirs:.5f} fp16 {fp16:.5f} "
            f"gap {abs(ours - theirs):.2e} bound {bound:.2e} {'ok' if within else 'OUT'}"
        )
    for index, state in enumerate(states):
        worst = worst_half = 0.0
        counts, out = True, []
        for name, theirs in reference_buffers[index].items():
            if not theirs.dtype.is_floating_point:
                counts &= torch.equal(state[name], theirs)
                continue
            scale = _scale(name, reference_buffers[index])
            error = _relative(state[name], theirs, scale)
            error_half = _relative(half_buffers[index][name], theirs, scale)
            worst, worst_half = max(worst, error), max(worst_half, error_half)
            if error > max(1e-2, 2 * error_half):
                out.append(name)
        ok &= counts and not out
        print(
            f"  step {index}: running statistics worst relative L2 {worst:.2e} "
            f"(torch fp16 {worst_half:.2e}); num_batches_tracked equal {counts}"
            + (f"; OUT {out}" if out else "")
        )
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
    args = parser.parse_args()
    qnn_convbwd.enable()
    results = [run(args, soc) for soc in args.soc]
    return 0 if all(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
