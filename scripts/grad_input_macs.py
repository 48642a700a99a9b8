#!/usr/bin/env python3
"""Multiply-adds of one frozen convolution's grad_input against the ideal, per stride mode.

Lowers weight_bytes' grad_input-only program ("bwd") of each config with each
``Options.stride`` mode, counts the MACs of the captured QNN ops with
``cost.qnn_op_macs`` and divides by the ideal (the forward convolution's MACs).
Also lists the static QNN tensors' bytes and the op types of the graph.

    python scripts/grad_input_macs.py --configs 128x128x3:s2:n15 512x256x1:s2:n16 \\
        --strides zero_insert parameter phases

A config is CINxCOUTxK with optional :sSTRIDE, :gGROUPS, :nSIZE (weight_bytes.ConvConfig).
"""

from __future__ import annotations

import argparse
import collections

from qnn_convbwd import integration, options
from qnn_convbwd_dev import cost, weight_bytes


def ideal(config: weight_bytes.ConvConfig) -> int:
    out = (config.size + 2 * config.padding - config.kernel) // config.stride + 1
    return (
        config.batch * config.c_out * out * out * config.kernel**2 * (config.c_in // config.groups)
    )


def measure(config: weight_bytes.ConvConfig, soc: str, mode: str) -> dict:
    with integration.capture_qnn_graphs() as graphs:
        _, _, compiled, _ = weight_bytes.lower(config, "bwd", soc, "runtime_weight", 0, mode)
    macs, types, static = 0, collections.Counter(), {}
    for ops in graphs:
        for op in ops:
            macs += cost.qnn_op_macs(op) or 0
            types[op.op_type] += 1
            for t in op.inputs:
                if t.is_static:
                    static[t.name] = t.nbytes
    return {
        "macs": macs,
        "types": types,
        "static": sum(static.values()),
        "context": compiled.context_binary_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["128x128x3:s2:n15"])
    parser.add_argument("--soc", default="SM8650")
    parser.add_argument("--strides", nargs="+", default=list(options.STRIDE_MODES))
    args = parser.parse_args()
    print(
        "| config | stride mode | MACs | ideal | ratio | static QNN B (fp32) | ctx bwd B "
        "| QNN ops |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for spec in args.configs:
        config = weight_bytes.ConvConfig.parse(spec)
        for mode in args.strides:
            m = measure(config, args.soc, mode)
            want = ideal(config)
            ops = ", ".join(f"{t} {n}" for t, n in sorted(m["types"].items()))
            print(
                f"| {config} | {mode} | {m['macs']:,} | {want:,} | {m['macs'] / want:.3f} "
                f"| {m['static']:,} | {m['context']:,} | {ops} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
