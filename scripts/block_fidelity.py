"""Each block of a torchvision model's ``features`` alone on the HTP simulator, fed
the whole training step's fp32 values: is any block's own arithmetic off?

For block k of ``zoo.step(arch, scheme, size)``, torch's fp32 step records the
activation ``a`` at the block's input and the gradient ``g`` at its output. The
probe ``sum(block(a + z) * g)``, ``z`` a zero parameter (its gradient is the
block's input gradient), trains the block's parameters as the scheme does and
is lowered like any joint graph. It is judged over ``a``, ``g`` and K - 1 fp16
neighbours (``fidelity.neighbours``), by the medians (``zoo.judges``). With no
error coming from upstream, a block whose HTP error is several times torch
fp16's computes worse than fp16, unless its draws split on a gate flip
(docs/zoo.md, "Judged on each side's own gates": MobileNetV3-Small's block 3).

    PYTHONPATH=. python scripts/block_fidelity.py mobilenet_v3_small --scheme full
        [--size 32] [--soc SM8650] [--neighbours 9] [--blocks 1 3] [--tensors]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.export.experimental import _export_forward_backward

from qnn_convbwd.toolchain import harness
from qnn_convbwd_dev import models, zoo
from qnn_convbwd_dev.reference_kernels import pinned


class Probe(torch.nn.Module):
    """``block`` with a zero parameter at its input and a fixed upstream gradient."""

    def __init__(self, block: torch.nn.Module, shape: torch.Size) -> None:
        super().__init__()
        self.block = block
        self.at_input = torch.nn.Parameter(torch.zeros(shape))

    def forward(self, a, g):
        return (self.block(a + self.at_input) * g).sum()


def boundaries(model: torch.nn.Module, inputs) -> tuple[list, list]:
    """Per block of ``model.net.features``: its fp32 input and its output's gradient."""
    blocks = list(model.net.features)
    ins: dict[int, torch.Tensor] = {}
    outs: dict[int, torch.Tensor] = {}
    handles = []
    for k, block in enumerate(blocks):

        def before(module, args, k=k):
            ins[k] = args[0].detach().clone()

        def after(module, args, out, k=k):
            out.retain_grad()
            outs[k] = out

        handles += [block.register_forward_pre_hook(before), block.register_forward_hook(after)]
    try:
        with pinned():
            model(*inputs).backward()
    finally:
        for handle in handles:
            handle.remove()
    model.zero_grad(set_to_none=True)
    return [ins[k] for k in range(len(blocks))], [outs[k].grad.detach() for k in range(len(blocks))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("arch")
    parser.add_argument("--scheme", default="full", choices=zoo.SCHEMES)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--soc", default="SM8650")
    parser.add_argument("--neighbours", type=int, default=9, metavar="K")
    parser.add_argument("--blocks", type=int, nargs="*", help="only these blocks")
    parser.add_argument("--tensors", action="store_true", help="every tensor's medians too")
    args = parser.parse_args()

    model, inputs = zoo.step(args.arch, args.scheme, args.size)
    ins, grads = boundaries(model, inputs)
    print(
        "| block | input | lower s | input gradient, HTP (fp16) | ratio "
        "| worst tensor by ratio, HTP (fp16) | medians |\n|---|---|---|---|---|---|---|"
    )
    for k, block in enumerate(model.net.features):
        if args.blocks and k not in args.blocks:
            continue
        probe = Probe(block, ins[k].shape)
        probe_inputs = (ins[k], grads[k].clone())
        joint = _export_forward_backward(torch.export.export(probe, probe_inputs, strict=True))
        graph = models.TrainingGraph(f"block {k}", probe, probe_inputs, joint)
        start = time.perf_counter()
        compiled = harness.lower_program(joint, args.soc)
        lower_s = time.perf_counter() - start
        reports = zoo.reports(graph, compiled, args.neighbours, around=True)
        median = dict(zoo.judges(reports, around=True))["medians"]
        rows = {r.name: r for r in median.rows}
        grad_in = rows["at_input"]
        worst = max(
            (r for r in median.rows if r.name != "loss"),
            key=lambda r: r.htp.rel_l2 / max(r.floor.rel_l2, 1e-30),
        )
        print(
            f"| {k} {type(block).__name__} | {tuple(ins[k].shape)} | {lower_s:.0f} "
            f"| {grad_in.htp.rel_l2:.3g} ({grad_in.floor.rel_l2:.3g}) "
            f"| {grad_in.htp.rel_l2 / max(grad_in.floor.rel_l2, 1e-30):.2f} "
            f"| {worst.name} {worst.htp.rel_l2:.3g} ({worst.floor.rel_l2:.3g}) "
            f"| {'within' if median.within else ', '.join(median.offending)} |",
            flush=True,
        )
        if args.tensors:
            print(median.to_markdown(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
