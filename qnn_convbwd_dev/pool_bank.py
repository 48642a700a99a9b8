"""Max-pool programs for the tests and ``scripts/max_pool_measure.py``: one
``max_pool2d_with_indices`` and its backward per configuration, on inputs with ties.

Tolerance of an HTP result: every grad_input element is a sum of the grad_output
elements routed to it, each rounded to fp16 (u = 2^-11), so its error is bounded by
~(count + 1) u times the same sum over absolute values, which is the backward of
``|grad_output|``; ``PoolBank.bounds`` allows 4u of it.
"""

from __future__ import annotations

import torch
from torch import nn

U = 2.0**-11


# (kernel, stride, padding, dilation, ceil_mode, input size)
ZOO_CONFIGS = {
    "k2s2_cifar": ((2, 2), (2, 2), (0, 0), (1, 1), False, (8, 8)),
    "k3s2p1_resnet": ((3, 3), (2, 2), (1, 1), (1, 1), False, (9, 9)),
    "k3s2_ceil_squeezenet": ((3, 3), (2, 2), (0, 0), (1, 1), True, (10, 10)),
    "k3s1p1_overlap": ((3, 3), (1, 1), (1, 1), (1, 1), False, (7, 7)),
    "k2x3_s1x2_p1x0_d2x1": ((2, 3), (1, 2), (1, 0), (2, 1), False, (9, 8)),
    # dilation 2 = stride: every offset in phase 0, the window_masks placement is used
    "k2s2d2_empty_phase": ((2, 2), (2, 2), (0, 0), (2, 2), False, (9, 9)),
}


def pool_args(config) -> list:
    kernel, stride, padding, dilation, ceil_mode, _ = config
    return [list(kernel), list(stride), list(padding), list(dilation), ceil_mode]


def tied_input(shape, seed: int) -> torch.Tensor:
    """ReLU output rounded to quarters: many exact ties (zeros and equal positives)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.round(torch.relu(torch.randn(*shape, generator=generator)) * 4) / 4


class PoolBank(nn.Module):
    """One max_pool2d_with_indices + its backward per config, on inputs (x_i, g_i);
    returns each grad_input, preceded by the pooled values with ``with_values``."""

    def __init__(self, configs, with_values: bool = False) -> None:
        super().__init__()
        self.configs = list(configs)
        self.with_values = with_values

    def forward(self, *tensors):
        out = []
        for config, x, g in zip(self.configs, tensors[0::2], tensors[1::2]):
            values, indices = torch.ops.aten.max_pool2d_with_indices(x, *pool_args(config))
            grad = torch.ops.aten.max_pool2d_with_indices_backward(
                g, x, *pool_args(config), indices
            )
            out += [values, grad] if self.with_values else [grad]
        return tuple(out)

    def inputs(self, seed: int = 0) -> tuple:
        tensors = []
        for number, config in enumerate(self.configs):
            x = tied_input((2, 4, *config[5]), seed + number)
            values, _ = torch.ops.aten.max_pool2d_with_indices(x, *pool_args(config))
            tensors += [
                x,
                torch.randn(values.shape, generator=torch.Generator().manual_seed(number)),
            ]
        return tuple(tensors)

    def bounds(self, inputs) -> list[torch.Tensor]:
        """4u times the backward of |grad_output| (see the module docstring)."""
        magnitudes = [t.abs() if i % 2 else t for i, t in enumerate(inputs)]
        return [4 * U * b + 1e-6 for b in self(*magnitudes)]
