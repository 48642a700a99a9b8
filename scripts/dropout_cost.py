"""What the dropout draw (passes/dropout.py) costs per step on this host's CPU.

For each activation shape: a program of one train-mode ``nn.Dropout`` rewritten by
the pass (the counter, the hash, the mask product), and the same mask product with a
fixed mask as a program input, both run by executorch's portable CPU kernels; the
difference of their median wall times is the draw. Prints one row per shape.

    python scripts/dropout_cost.py --shapes 4x512 32x1280 --calls 200
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


class _Drop(torch.nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.drop = torch.nn.Dropout(p)

    def forward(self, x):
        return self.drop(x)


class _Product(torch.nn.Module):
    def forward(self, x, scaled_mask):
        return x * scaled_mask


def _program(module: torch.nn.Module, inputs: tuple, rewrite: bool) -> bytes:
    from executorch.exir import EdgeCompileConfig, to_edge

    from qnn_convbwd.passes import dropout

    exported = torch.export.export(module.train(), inputs, strict=True)
    if rewrite:
        exported, _ = dropout.rewrite(exported, seed=0)
    config = EdgeCompileConfig(_check_ir_validity=False)  # bitwise_right_shift: not core ATen
    return to_edge(exported, compile_config=config).to_executorch().buffer


def _median_seconds(pte: bytes, inputs: list, calls: int) -> float:
    from executorch.runtime import Runtime

    method = Runtime.get().load_program(pte).load_method("forward")
    for _ in range(5):
        method.execute(inputs)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        method.execute(inputs)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["4x512"])
    parser.add_argument("--p", type=float, default=0.5)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    print("| shape | elements | draw + product ms | product alone ms | draw ms |")
    print("|---|---|---|---|---|")
    for text in args.shapes:
        shape = tuple(int(s) for s in text.split("x"))
        x = torch.randn(shape)
        mask = torch.ones(shape)
        with_draw = _median_seconds(_program(_Drop(args.p), (x,), True), [x], args.calls)
        product = _median_seconds(_program(_Product(), (x, mask), False), [x, mask], args.calls)
        print(
            f"| {text} | {x.numel()} | {with_draw * 1e3:.3f} | {product * 1e3:.3f} "
            f"| {(with_draw - product) * 1e3:.3f} |"
        )


if __name__ == "__main__":
    main()
