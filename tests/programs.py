"""Programs made of explicit ``aten.convolution_backward`` calls, for tests.

``ConvBackwardBank`` holds one frozen weight per configuration and computes
every configuration's grad_input in one forward, so many configurations
compile into one QNN program (one compile per SoC instead of one per config).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class Config:
    """One convolution_backward call; per-dim tuples have one entry per spatial dim."""

    batch: int
    cin: int
    cout: int
    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    groups: int
    size: tuple[int, ...]  # spatial size of the forward input
    dilation: tuple[int, ...] | None = None  # None: 1 in every dim
    mask: tuple[bool, bool, bool] = (True, False, False)

    def __post_init__(self) -> None:
        if self.dilation is None:
            object.__setattr__(self, "dilation", (1,) * len(self.kernel))

    @property
    def output_size(self) -> tuple[int, ...]:
        return tuple(
            (i + 2 * p - d * (k - 1) - 1) // s + 1
            for i, k, s, p, d in zip(
                self.size, self.kernel, self.stride, self.padding, self.dilation, strict=True
            )
        )

    def valid(self) -> bool:
        return (
            self.cin % self.groups == 0
            and self.cout % self.groups == 0
            and all(o >= 1 for o in self.output_size)
        )

    def __str__(self) -> str:
        def dims(values) -> str:
            return "x".join(map(str, values))

        text = (
            f"n{self.batch}_c{self.cin}x{self.cout}_k{dims(self.kernel)}"
            f"_s{dims(self.stride)}_p{dims(self.padding)}"
            f"_g{self.groups}_{dims(self.size)}"
        )
        if any(d != 1 for d in self.dilation):
            text += f"_d{dims(self.dilation)}"
        if self.mask != (True, False, False):
            text += "_m" + "".join("1" if m else "0" for m in self.mask)
        return text


def generate_configs(count: int, seed: int = 0) -> list[Config]:
    """Deterministic spread: stride 1-3, padding 0-2, kernels 1-5 incl. 3x1 and 1x1,
    groups 1 / 2 / depthwise, odd and even sizes, batch 1 and 2."""
    rng = random.Random(seed)
    kernels = [(1, 1), (3, 1), (1, 3), (2, 2), (3, 3), (4, 4), (5, 5), (5, 3)]
    configs: list[Config] = []
    while len(configs) < count:
        kind = len(configs) % 3  # rotate groups: 1, 2, depthwise
        cin = rng.choice([4, 8, 16])
        if kind == 0:
            groups, cout = 1, rng.choice([4, 8, 16])
        elif kind == 1:
            groups, cout = 2, rng.choice([4, 8, 16])
        else:
            groups, cout = cin, cin * rng.choice([1, 2])
        kernel = kernels[len(configs) % len(kernels)]
        stride = (rng.randint(1, 3), rng.randint(1, 3))
        padding = tuple(rng.randint(0, min(2, k - 1 if k > 1 else 0)) for k in kernel)
        size = (rng.randint(5, 16), rng.randint(5, 16))
        config = Config(rng.choice([1, 2]), cin, cout, kernel, stride, padding, groups, size)
        if config.valid():
            configs.append(config)
    return configs


# Every output_mask that asks for something.
ALL_MASKS = tuple(
    m
    for m in ((a, b, c) for a in (True, False) for b in (True, False) for c in (True, False))
    if any(m)
)


def generate_3d_configs(count: int, seed: int = 0) -> list[Config]:
    """Deterministic 3-D spread: strides 1-2 per dim (H != W ones make grad_input
    reorder its spatial dims), padding 0-1, kernels 1-3 incl. 3x1x1 and 2x3x3,
    groups 1 / 2 / depthwise, every output_mask, odd and even sizes, batch 1 and 2."""
    rng = random.Random(seed)
    kernels = [(3, 3, 3), (1, 1, 1), (3, 1, 1), (2, 3, 3), (1, 3, 3), (3, 2, 2)]
    configs: list[Config] = []
    while len(configs) < count:
        kind = len(configs) % 3  # rotate groups: 1, 2, depthwise
        cin = rng.choice([2, 4, 6])
        if kind == 0:
            groups, cout = 1, rng.choice([2, 4, 6])
        elif kind == 1:
            groups, cout = 2, rng.choice([2, 4, 6])
        else:
            groups, cout = cin, cin * rng.choice([1, 2])
        kernel = kernels[len(configs) % len(kernels)]
        stride = tuple(rng.randint(1, 2) for _ in kernel)
        padding = tuple(rng.randint(0, min(1, k - 1)) for k in kernel)
        size = tuple(rng.randint(3, 7) for _ in kernel)
        mask = ALL_MASKS[len(configs) % len(ALL_MASKS)]
        config = Config(
            rng.choice([1, 2]), cin, cout, kernel, stride, padding, groups, size, mask=mask
        )
        if config.valid():
            configs.append(config)
    return configs


class ConvBackwardBank(nn.Module):
    """forward(*grad_outputs) -> every config's grad_input (output_mask [T, F, F])."""

    def __init__(self, configs: list[Config], seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.configs = configs
        self.weights = nn.ParameterList(
            nn.Parameter(
                torch.randn(c.cout, c.cin // c.groups, *c.kernel, generator=gen)
                / (math.prod(c.kernel) * c.cin // c.groups) ** 0.5,
                requires_grad=False,
            )
            for c in configs
        )
        for i, c in enumerate(configs):
            # grad_weight reads the forward input's values; grad_input only its shape.
            self.register_buffer(f"input_{i}", torch.randn(c.batch, c.cin, *c.size, generator=gen))

    def forward(self, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        results = []
        for i, (c, g) in enumerate(zip(self.configs, grad_outputs, strict=True)):
            grads = torch.ops.aten.convolution_backward.default(
                g,
                getattr(self, f"input_{i}"),
                self.weights[i],
                [c.cout] if c.mask[2] else None,
                list(c.stride),
                list(c.padding),
                list(c.dilation),
                False,
                [0] * len(c.stride),
                c.groups,
                list(c.mask),
            )
            results.extend(t for t, m in zip(grads, c.mask, strict=True) if m)
        return tuple(results)

    def example_inputs(self, seed: int = 1) -> tuple[torch.Tensor, ...]:
        gen = torch.Generator().manual_seed(seed)
        return tuple(
            torch.randn(c.batch, c.cout, *c.output_size, generator=gen) for c in self.configs
        )

    def export(self) -> torch.export.ExportedProgram:
        return torch.export.export(self, self.example_inputs(), strict=True)


U_FP16 = 2.0**-11


def assert_bank_matches(compiled, bank: ConvBackwardBank, factor: float = 4.0) -> float:
    """Every output of a compiled bank within ``factor`` u of its fp16 error scale;
    returns the worst ratio (in u)."""
    grad_outputs = bank.example_inputs()
    got = iter(compiled.run(grad_outputs))
    expected = iter(bank(*grad_outputs))
    worst = 0.0
    for i, (config, g) in enumerate(zip(bank.configs, grad_outputs, strict=True)):
        bounds = fp16_error_bounds(config, bank.weights[i], getattr(bank, f"input_{i}"), g)
        for bound in bounds:
            a, b = next(got), next(expected)
            ratio = ((a - b).abs() / (U_FP16 * bound + 1e-6)).max().item()
            assert ratio <= factor, f"{config}: error {ratio:.2f} u-bounds"
            worst = max(worst, ratio)
    return worst


def fp16_error_bounds(
    config: Config, weight: torch.Tensor, inputs: torch.Tensor, grad_output: torch.Tensor
) -> list[torch.Tensor]:
    """Element-wise fp16 error scales of every requested output (the argument of
    ``fp16_error_bound``): each output is a sum of products, so its scale is the
    same sum over absolute values."""
    grads = torch.ops.aten.convolution_backward.default(
        grad_output.abs(),
        inputs.abs(),
        weight.abs(),
        [config.cout],
        list(config.stride),
        list(config.padding),
        list(config.dilation),
        False,
        [0] * len(config.stride),
        config.groups,
        [True, True, True],
    )
    return [t for t, m in zip(grads, config.mask, strict=True) if m]


def fp16_error_bound(config: Config, weight: torch.Tensor, grad_output: torch.Tensor):
    """Element-wise scale for fp16 error of grad_input: the transposed convolution of
    |g| with |w|.

    Rounding both operands to fp16 perturbs every product by at most ~2u
    (u = 2^-11), so |error_i| <= c * u * sum_j |g_j| |w_ij| for a small c when the
    sums are accumulated in higher precision. Tests compare against c * u * this.
    """
    inputs = torch.zeros(config.batch, config.cin, *config.size)
    return fp16_error_bounds(config, weight, inputs, grad_output)[0]


def conv_backward_of(config: Config):
    """The parsed form of the config's convolution_backward node, without exporting."""
    from qnn_convbwd.geometry import conv as geo

    return geo.ConvBackward(
        grad_output_shape=(config.batch, config.cout, *config.output_size),
        input_shape=(config.batch, config.cin, *config.size),
        weight_shape=(config.cout, config.cin // config.groups, *config.kernel),
        stride=config.stride,
        padding=config.padding,
        dilation=config.dilation,
        transposed=False,
        output_padding_arg=(0,) * len(config.stride),
        groups=config.groups,
        output_mask=config.mask,
        dtype=torch.float32,
    )


def assert_step_within_twice_torch_fp16(
    net: nn.Module, x: torch.Tensor, y: torch.Tensor, outputs: dict[str, torch.Tensor]
) -> None:
    """A training step's ``outputs`` (the loss, and ``net.<name>`` gradients) within twice
    torch fp16's own error + 1e-3 of torch fp32's cross-entropy step on ``net``."""
    reference = {}
    for dtype in (torch.float32, torch.float16):
        model = copy.deepcopy(net).to(dtype)
        loss = nn.functional.cross_entropy(model(x.to(dtype)).float(), y)
        loss.backward()
        reference[dtype] = float(loss), {n: p.grad.double() for n, p in model.named_parameters()}
    (loss32, grads32), (loss16, grads16) = reference[torch.float32], reference[torch.float16]
    assert abs(float(outputs["loss"]) - loss32) <= 2 * abs(loss16 - loss32) + 1e-3
    for name, want in grads32.items():
        error = float((outputs[f"net.{name}"].double() - want).norm() / want.norm())
        floor = float((grads16[name] - want).norm() / want.norm())
        assert error <= 2 * floor + 1e-3, f"{name}: {error:.2e} against torch fp16 {floor:.2e}"
