"""Average-pool backward programs for the tests: one ``avg_pool2d_backward`` per
configuration, on inputs (x_i, g_i).

Tolerance of an HTP result: every grad_input element is a sum of at most ``count``
grad_output elements (``count``: how many windows overlap one element), each
multiplied by an fp16 reciprocal of its divisor (two roundings, u = 2^-11), the sum
rounded once per addition; its error is bounded by ~(count + 2) u times the same sum
over absolute values, which is the backward of ``|grad_output|``
(``AvgPoolBank.bounds``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

U = 2.0**-11

# name -> (kernel, stride, padding, ceil_mode, count_include_pad, divisor_override, size)
CONFIGS = {
    "k2s2_densenet": ((2, 2), (2, 2), (0, 0), False, True, None, (8, 8)),
    "k3s1p1_include_pad": ((3, 3), (1, 1), (1, 1), False, True, None, (7, 7)),
    "k3s1p1_exclude_pad": ((3, 3), (1, 1), (1, 1), False, False, None, (7, 7)),
    "k3s2p1_ceil_exclude_pad": ((3, 3), (2, 2), (1, 1), True, False, None, (8, 9)),
    "k3s2_ceil_past_the_input": ((3, 3), (2, 2), (0, 0), True, True, None, (10, 10)),
    "k2x3_s1x2_p1x0_divisor5": ((2, 3), (1, 2), (1, 0), False, True, 5, (9, 8)),
    "k2s3_empty_phase": ((2, 2), (3, 3), (0, 0), False, True, None, (8, 8)),
    "k3s3p1_ceil_include_pad": ((3, 3), (3, 3), (1, 1), True, True, None, (8, 7)),
}


def pool_args(config) -> list:
    kernel, stride, padding, ceil_mode, count_include_pad, divisor, _ = config
    return [list(kernel), list(stride), list(padding), ceil_mode, count_include_pad, divisor]


def overlap(config) -> int:
    """How many windows at most cover one input element."""
    kernel, stride = config[0], config[1]
    return math.prod(-(-k // s) for k, s in zip(kernel, stride))


class AvgPoolBank(nn.Module):
    """One ``avg_pool2d_backward`` per config, on inputs (x_i, g_i); returns each grad_input."""

    def __init__(self, configs) -> None:
        super().__init__()
        self.configs = list(configs)

    def forward(self, *tensors):
        return tuple(
            torch.ops.aten.avg_pool2d_backward(g, x, *pool_args(config))
            for config, x, g in zip(self.configs, tensors[0::2], tensors[1::2])
        )

    def inputs(self, seed: int = 0, channels: int = 3) -> tuple:
        tensors = []
        for number, config in enumerate(self.configs):
            generator = torch.Generator().manual_seed(seed + number)
            x = torch.randn(2, channels, *config[-1], generator=generator)
            pooled = torch.ops.aten.avg_pool2d(x, *pool_args(config))
            tensors += [x, torch.randn(pooled.shape, generator=generator)]
        return tuple(tensors)

    def bounds(self, inputs) -> list[torch.Tensor]:
        """(count + 2) u times the backward of |grad_output| (see the module docstring)."""
        magnitudes = [t.abs() if i % 2 else t for i, t in enumerate(inputs)]
        return [
            (overlap(config) + 2) * U * b + 1e-6
            for config, b in zip(self.configs, self(*magnitudes))
        ]
