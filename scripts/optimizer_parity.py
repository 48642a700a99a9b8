"""The optimizer inside the program against torch.optim, on the HTP simulator.

``digits``: ExecuTorch's CIFAR model as shipped (dropout 0.5, ``train()``) trained on
scikit-learn's digits (32x32, ``finetune.digits``) for ``--steps`` steps with the
program's own AdamW, and torch eager fp32 + ``torch.optim.AdamW`` from the same
initial weights on the same batches. Prints both test accuracies (the program's
trained ``state_dict`` evaluated by torch eager on the 297 test images) and the loss
curves' last values.

``resnet18``: torchvision's resnet18 in ``train()``, every parameter trained, batch
``--batch``, 32x32, cross-entropy, ``--steps`` steps of the program's AdamW against
torch fp32 + AdamW and torch fp16 autocast + AdamW (the fp16 floor), step by step:
each loss, its gap to fp32, and the bound ``max(3e-2 * max(1, |loss|), 2 * fp16's gap)``;
and each step's parameter update against fp32's: cosine and the fraction of elements
moved in the same direction, for the program and for fp16 autocast.

``sgd``: the same for SGD with momentum (``--model resnet18`` or ``cifar``): the
program's own SGD on the HTP against torch fp32 + torch.optim.SGD, and against the
same program without the optimizer stepped by executorch's SGD (to the bit).

    python scripts/optimizer_parity.py digits --steps 150
    python scripts/optimizer_parity.py resnet18 --steps 5 --batch 8
    python scripts/optimizer_parity.py sgd --model resnet18 --steps 5 --batch 8

Writes ``--json`` when given.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import time

import torch
from torch import nn


def _lower(net: nn.Module, example: tuple, optimizer, args: argparse.Namespace, scale=None):
    import qnn_convbwd
    from qnn_convbwd import training
    from qnn_convbwd.toolchain import harness

    module = training.WithLoss(copy.deepcopy(net), nn.functional.cross_entropy)
    with qnn_convbwd.enabled(dropout_seed=args.dropout_seed):
        program = training.lower_for_training(
            module,
            example,
            harness.compile_specs(args.soc),
            optimizer=optimizer,
            loss_scale=scale,
        )
    rules = collections.Counter(op.rule for op in program.report.on_cpu)
    print(
        f"lowered in {program.lowering_seconds:.0f} s: "
        f"{harness.delegate_count(program.edge)} delegate(s), on CPU by rule {dict(rules)}",
        flush=True,
    )
    return program


def _torch_step(net: nn.Module, optimizer, x, y, autocast: bool = False, scaler=None) -> float:
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
        loss = nn.functional.cross_entropy(net(x), y)
    if scaler is None:
        loss.backward()
        optimizer.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return float(loss)


def digits(args: argparse.Namespace) -> dict:
    from qnn_convbwd import finetune, training

    split = finetune.digits(32, seed=0)
    net = finetune.architecture("cifar", 10, seed=0).train()
    generator = torch.Generator().manual_seed(1)
    batches = []
    while len(batches) < args.steps:
        batches.extend(finetune._epoch_batches(split.train, args.batch, generator))
    batches = batches[: args.steps]
    opt = training.AdamW(args.lr, weight_decay=args.weight_decay)
    program = _lower(net, batches[0], opt, args)
    session = program.session()
    reference = copy.deepcopy(net)
    torch_opt = opt.torch_optimizer([p for p in reference.parameters() if p.requires_grad])
    ours, theirs = [], []
    start = time.perf_counter()
    for index, (x, y) in enumerate(batches):
        ours.append(session.step([x, y]))
        theirs.append(_torch_step(reference, torch_opt, x, y))
        if index % 10 == 9 or index == len(batches) - 1:
            print(
                f"step {index + 1}: program {ours[-1]:.4f}, torch {theirs[-1]:.4f}, "
                f"{time.perf_counter() - start:.0f} s",
                flush=True,
            )
    trained = copy.deepcopy(net)
    trained.load_state_dict(session.state_dict())
    session.close()
    result = {
        "steps": args.steps,
        "batch": args.batch,
        "program_accuracy": finetune.accuracy(trained, split.test),
        "torch_accuracy": finetune.accuracy(reference, split.test),
        "program_losses": ours,
        "torch_losses": theirs,
        "lowering_seconds": program.lowering_seconds,
        "step_seconds": (time.perf_counter() - start) / len(batches),
    }
    print(
        f"test accuracy: program {result['program_accuracy']:.4f}, "
        f"torch {result['torch_accuracy']:.4f} (297 images)"
    )
    return result


def _flat(state: dict, net: nn.Module) -> torch.Tensor:
    """The trainable parameters of ``state`` (a state_dict) as one vector."""
    return torch.cat([state[name].detach().flatten().float() for name, _ in net.named_parameters()])


def stepwise(args: argparse.Namespace, opt) -> dict:
    from qnn_convbwd import finetune, training

    net = finetune.architecture(args.model, 10, seed=args.seed).train()
    generator = torch.Generator().manual_seed(args.seed + 1)
    batches = [
        (
            torch.randn(args.batch, 3, 32, 32, generator=generator),
            torch.randint(0, 10, (args.batch,), generator=generator),
        )
        for _ in range(args.steps)
    ]
    scale = None
    scaler = None
    if args.loss_scale:
        scale = training.DynamicLossScale(init_scale=args.loss_scale)
        scaler = torch.amp.GradScaler("cpu", init_scale=args.loss_scale)
    program = _lower(net, batches[0], opt, args, scale)
    session = program.session()
    fp32, fp16 = copy.deepcopy(net), copy.deepcopy(net)
    opt32 = opt.torch_optimizer(list(fp32.parameters()))
    opt16 = opt.torch_optimizer(list(fp16.parameters()))
    rows = []
    print(
        "| step | program | torch fp32 | gap | fp16 autocast gap | bound | within "
        "| update cosine to fp32: program, autocast | sign agreement: program, autocast |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for index, (x, y) in enumerate(batches):
        before = {
            "program": _flat(session.state_dict(), net),
            "fp32": _flat(fp32.state_dict(), net),
            "fp16": _flat(fp16.state_dict(), net),
        }
        ours = session.step([x, y])
        ref = _torch_step(fp32, opt32, x, y)
        half = _torch_step(fp16, opt16, x, y, autocast=True, scaler=scaler)
        after = {
            "program": _flat(session.state_dict(), net),
            "fp32": _flat(fp32.state_dict(), net),
            "fp16": _flat(fp16.state_dict(), net),
        }
        update = {k: after[k] - before[k] for k in after}
        cosine = {
            k: float(nn.functional.cosine_similarity(update[k], update["fp32"], dim=0))
            for k in ("program", "fp16")
        }
        signs = {
            k: float((update[k].sign() == update["fp32"].sign()).float().mean())
            for k in ("program", "fp16")
        }
        gap, floor = abs(ours - ref), abs(half - ref)
        bound = max(3e-2 * max(1.0, abs(ref)), 2 * floor)
        rows.append(
            {
                "step": index + 1,
                "program": ours,
                "torch": ref,
                "fp16": half,
                "bound": bound,
                "update_cosine": cosine,
                "sign_agreement": signs,
            }
        )
        if scale is not None:
            rows[-1]["scale"] = session.loss_scale
        print(
            f"| {index + 1} | {ours:.5f} | {ref:.5f} | {gap:.2e} | {floor:.2e} | {bound:.2e} | "
            f"{'yes' if gap <= bound else 'NO'} | {cosine['program']:.3f}, {cosine['fp16']:.3f} "
            f"| {signs['program']:.3f}, {signs['fp16']:.3f} |",
            flush=True,
        )
    session.close()
    result = {"rows": rows, "lowering_seconds": program.lowering_seconds}
    if isinstance(opt, training.SGD):
        # The same joint program without the optimizer, stepped by executorch's SGD.
        plain = _lower(net, batches[0], None, args)
        session = plain.session(opt.lr, momentum=opt.momentum)
        theirs = [session.step(list(batch)) for batch in batches]
        session.close()
        ours = [row["program"] for row in rows]
        result["executorch_sgd_losses"] = theirs
        result["equal_to_executorch_sgd"] = ours == theirs
        print(
            f"executorch's SGD path: {theirs}; in-program losses equal to the bit: {ours == theirs}"
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("job", choices=["digits", "resnet18", "sgd"])
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=1e-2)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--model", default="resnet18", help="sgd: resnet18 or cifar")
    parser.add_argument("--soc", default="SM8650")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--loss-scale",
        type=float,
        default=None,
        help="a dynamic loss scale in the program starting here (GradScaler for torch fp16)",
    )
    parser.add_argument("--seed", type=int, default=0, help="stepwise: weights and batches")
    parser.add_argument("--dropout-seed", type=int, default=0, help="the program's dropout keys")
    args = parser.parse_args()
    from qnn_convbwd import training

    if args.job == "digits":
        args.steps, args.batch = args.steps or 150, args.batch or 16
        result = digits(args)
    elif args.job == "resnet18":
        args.steps, args.batch, args.model = args.steps or 5, args.batch or 8, "resnet18"
        result = stepwise(args, training.AdamW(args.lr, weight_decay=args.weight_decay))
    else:
        args.steps, args.batch = args.steps or 5, args.batch or 8
        result = stepwise(args, training.SGD(args.lr, momentum=args.momentum))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"job": args.job, "args": vars(args), **result}, handle, indent=1)


if __name__ == "__main__":
    main()
