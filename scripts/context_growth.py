#!/usr/bin/env python3
"""Which part of a compiled program grows with the input size: context bytes per program.

For one frozen convolution (``weight_bytes.ConvConfig``, e.g. 256x512x1) at
several input sizes, compiles (no simulator run):

* ``fwd``, ``fwd+bwd``, ``bwd``: the programs of ``qnn_convbwd_dev.weight_bytes``
  (the forward convolution, both, the grad_input ``convolution_backward`` alone);
* ``fwd+bwd transpose_conv``, ``bwd transpose_conv``: the same with
  ``input_gradient="transpose_conv"`` (each convolution reads its own static
  filter, no run-time weight);
* ``relu in`` / ``relu out``: one ReLU over a tensor of the forward input's /
  grad_output's shape (no weight at all);

and prints, per program and size, the QNN context-binary bytes, the static
bytes handed to QNN (``integration.capture_qnn_graphs``) and the QNN ops.
The static bytes tell whether a size-dependent growth is data (a tensor) or
the HTP's compiled program for the ops.

    PYTHONPATH=. python scripts/context_growth.py --config 256x512x1 --sizes 8 16 32
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

import torch

from qnn_convbwd import integration
from qnn_convbwd.toolchain import harness
from qnn_convbwd_dev import weight_bytes


class Relu(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)


def compiled_row(label: str, size: int, lower) -> str:
    with integration.capture_qnn_graphs() as graphs:
        compiled = lower()
    static = {
        (i, t.name): t.nbytes
        for i, ops in enumerate(graphs)
        for op in ops
        for t in (*op.inputs, *op.outputs)
        if t.is_static
    }
    ops = Counter(op.op_type for g in graphs for op in g)
    text = ", ".join(f"{k} {v}" for k, v in sorted(ops.items()))
    return (
        f"| {label} | {size} | {compiled.context_binary_bytes:,} | {sum(static.values()):,} "
        f"| {harness.delegate_count(compiled.edge)} | {text} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="256x512x1")
    parser.add_argument("--sizes", nargs="+", type=int, default=[8, 16, 32])
    parser.add_argument("--soc", default="SM8450")
    args = parser.parse_args(argv)
    print(
        "| program | px | context B | static B | delegates | QNN ops |\n|---|---|---|---|---|---|",
        flush=True,
    )
    base = weight_bytes.ConvConfig.parse(args.config)
    for size in args.sizes:
        config = weight_bytes.ConvConfig(**{**base.__dict__, "size": size})
        x, grad_output = weight_bytes.example_inputs(config)
        for program, formulation in (
            ("fwd", "runtime_weight"),
            ("fwd+bwd", "runtime_weight"),
            ("bwd", "runtime_weight"),
            ("fwd+bwd", "transpose_conv"),
            ("bwd", "transpose_conv"),
        ):
            label = program if formulation == "runtime_weight" else f"{program} {formulation}"
            print(
                compiled_row(
                    label,
                    size,
                    lambda p=program, f=formulation, c=config: weight_bytes.lower(
                        c, p, args.soc, f
                    )[2],
                ),
                flush=True,
            )
        for label, tensor in (("relu in", x), ("relu out", grad_output)):
            print(
                compiled_row(
                    label, size, lambda t=tensor: harness.lower_module(Relu(), (t,), args.soc)
                ),
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
