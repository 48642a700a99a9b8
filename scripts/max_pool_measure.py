"""Measure the max_pool2d_with_indices_backward formulations on the HTP simulator.

    python scripts/max_pool_measure.py --soc SM8650,SM8850 --formulation window_masks

One program per (config, SoC, formulation): the forward pool and its backward on
tied inputs (ReLU output rounded to quarters). Prints one markdown row each:
compiled, delegated, QNN ops, max abs error vs torch and the reference's max.
The numbers in docs/max_pool.md come from this script.
"""

from __future__ import annotations

import argparse
import collections

import torch

from qnn_convbwd import integration
from qnn_convbwd.builders import op_max_pool_backward as mpb
from qnn_convbwd.toolchain import harness
from qnn_convbwd_dev.pool_bank import ZOO_CONFIGS, PoolBank


def measure(name: str, soc: str, formulation: str) -> str:
    mpb.FORMULATION = formulation
    bank = PoolBank([ZOO_CONFIGS[name]])
    inputs = bank.inputs()
    (expected,) = bank(*inputs)
    try:
        with integration.capture_qnn_graphs() as graphs:
            compiled = harness.lower_program(torch.export.export(bank, inputs), soc)
    except Exception as err:  # a failed compile is a result here
        return f"| {name} | {soc} | {formulation} | no ({type(err).__name__}) | - | - | - |"
    left = sum(
        "max_pool2d_with_indices_backward" in str(n.target)
        for n in compiled.edge.exported_program().graph.nodes
    )
    if left:
        return f"| {name} | {soc} | {formulation} | yes | no (op validation) | - | - |"
    ops = collections.Counter(op.op_type for graph in graphs for op in graph)
    (got,) = compiled.run(inputs)
    error = (got - expected).abs().max().item()
    return (
        f"| {name} | {soc} | {formulation} | yes | yes | {sum(ops.values())} | "
        f"{error:.2e} (max {expected.abs().max().item():.2f}) |"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--soc", default="SM8650")
    parser.add_argument("--formulation", default="window_masks")
    parser.add_argument("--config", default=",".join(ZOO_CONFIGS))
    args = parser.parse_args()
    print("| config | SoC | formulation | compiled | delegated | QNN ops | max abs error |")
    print("|---|---|---|---|---|---|---|")
    for name in args.config.split(","):
        for soc in args.soc.split(","):
            for formulation in args.formulation.split(","):
                print(measure(name, soc, formulation), flush=True)


if __name__ == "__main__":
    main()
