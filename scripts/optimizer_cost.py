"""What the in-program optimizer (passes/optimizer.py) costs: lowering time, step time on
this host's CPU, and where its ops run.

One model is lowered for SM8350 (HTP V68: the whole program on executorch's CPU
kernels) without an optimizer and with each in-program optimizer; every program runs
``--calls`` steps on the same batch and the median wall time per call is printed:
``forward`` alone (forward + backward, gradients out), executorch's SGD after it
(``TrainingSession.step``), and one call of each in-program step. The difference
between an in-program step and ``forward`` alone is the update's cost. Then
``qnn_convbwd.decide`` (no compile) partitions the program with an optimizer for
``--soc`` and counts the nodes of each rule that keeps something on CPU.

    python scripts/optimizer_cost.py --model cifar --calls 20
"""

from __future__ import annotations

import argparse
import collections
import copy
import statistics
import time

import torch


def _model(name: str) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    from qnn_convbwd import training
    from qnn_convbwd.commands import models

    torch.manual_seed(0)
    if name == "cifar":
        from executorch.extension.training.examples.CIFAR.model import CIFAR10Model

        net = CIFAR10Model().train()
        x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
        return training.WithLoss(net, torch.nn.functional.cross_entropy), (x, y)
    _, model, inputs = models.reference_model(name, trainable_backbone=True)
    return model, inputs


def _median_seconds(call, calls: int, *args) -> float:
    call(*args)  # the first call loads and warms up
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="cifar", help="cifar, or a commands.models backbone")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--soc", default="SM8650", help="the SoC whose partition is counted")
    args = parser.parse_args()

    import qnn_convbwd
    from qnn_convbwd import training
    from qnn_convbwd.passes import optimizer as optimizer_pass
    from qnn_convbwd.toolchain import harness

    module, inputs = _model(args.model)
    specs = harness.compile_specs("SM8350")
    optimizers = {
        "SGD(momentum=0.9)": training.SGD(0.01, momentum=0.9),
        "AdamW": training.AdamW(1e-3),
    }
    print(f"model {args.model}, {args.calls} calls, median seconds per call (SM8350, CPU only)")
    plain = training.lower_for_training(copy.deepcopy(module), inputs, specs)
    print("| program | lowering s | step s |\n|---|---|---|")
    session = plain.session(0.01, momentum=0.9)
    forward = _median_seconds(session.forward_backward, args.calls, list(inputs))
    print(f"| no optimizer: forward alone | {plain.lowering_seconds:.1f} | {forward:.4f} |")
    sgd = _median_seconds(session.step, args.calls, list(inputs))
    print(f"| no optimizer: forward + executorch's SGD | - | {sgd:.4f} |")
    session.close()
    for name, optimizer in optimizers.items():
        program = training.lower_for_training(
            copy.deepcopy(module), inputs, specs, optimizer=optimizer
        )
        session = program.session()
        step = _median_seconds(session.step, args.calls, list(inputs))
        session.close()
        print(
            f"| in-program {name} | {program.lowering_seconds:.1f} | {step:.4f} "
            f"(update {step - forward:+.4f}) |"
        )

    joint = training.export_joint(copy.deepcopy(module), inputs)
    program, _ = optimizer_pass.attach(joint, optimizers["AdamW"])
    report = qnn_convbwd.decide(program, harness.compile_specs(args.soc))
    rules = collections.Counter(op.rule for op in report.on_cpu)
    print(f"\n{args.soc}, AdamW in the program: ops kept on CPU, by rule")
    for rule, count in rules.most_common():
        print(f"  {rule}: {count}")


if __name__ == "__main__":
    main()
