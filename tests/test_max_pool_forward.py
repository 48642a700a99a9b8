"""The forward max_pool2d_with_indices on the HTP with its indices (issue 12).

The plugin's visitor (builders/op_max_pool_with_indices.py) computes the indices
in the graph; they never leave the delegate, so they are checked through the
backward that reads them: the input repeats one plane over ``P = OH * OW``
channels and channel ``c``'s grad_output is 1 at output position ``c`` only.
grad_input's channel ``c`` is then 1 exactly at the element the forward chose
for window ``c`` (one nonzero, no sum, exact in fp16) and 0 elsewhere: its flat
position is the forward's index, compared with torch's exactly.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

from qnn_convbwd import integration

BACKWARD = "max_pool2d_with_indices_backward"
FORWARD = "max_pool2d_with_indices"

# (kernel, stride, padding, dilation, ceil_mode, input size)
CONFIGS = {
    "k2s2": ((2, 2), (2, 2), (0, 0), (1, 1), False, (8, 8)),
    "k3s2p1": ((3, 3), (2, 2), (1, 1), (1, 1), False, (9, 9)),
    "k3s2_ceil": ((3, 3), (2, 2), (0, 0), (1, 1), True, (10, 10)),
    "k3s1p1_d2": ((3, 3), (1, 1), (1, 1), (2, 2), False, (7, 7)),
}


def pool_args(config) -> list:
    kernel, stride, padding, dilation, ceil_mode, _ = config
    return [list(kernel), list(stride), list(padding), list(dilation), ceil_mode]


def plane(kind: str, size, seed: int) -> torch.Tensor:
    """One input plane [1, 1, H, W]: random, or tie-heavy (ReLU'd, or few values)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 1, *size, generator=generator)
    if kind == "relu":  # about half exact zeros, as after a ReLU
        return torch.relu(x)
    if kind == "few_values":  # quantised to 3 levels: ties everywhere
        return torch.clamp(torch.round(x), -1, 1)
    return x


class ProbeIndices(nn.Module):
    """A pool and its backward per config; returns the values and grad_input."""

    def __init__(self, configs) -> None:
        super().__init__()
        self.configs = list(configs)

    def forward(self, *tensors):
        out = []
        for config, x, g in zip(self.configs, tensors[0::2], tensors[1::2]):
            values, indices = torch.ops.aten.max_pool2d_with_indices(x, *pool_args(config))
            grad = torch.ops.aten.max_pool2d_with_indices_backward(
                g, x, *pool_args(config), indices
            )
            out += [values, grad]
        return tuple(out)


def probe_inputs(configs, kind: str, seed: int):
    """Per config: the plane repeated over P channels (batch 2) and the one-hot grads."""
    tensors = []
    for number, config in enumerate(configs):
        planes = torch.cat([plane(kind, config[5], seed + 10 * number + n) for n in range(2)])
        values, _ = torch.ops.aten.max_pool2d_with_indices(planes, *pool_args(config))
        positions = values[0, 0].numel()
        x = planes.expand(-1, positions, -1, -1).contiguous()
        one_hot = torch.eye(positions).reshape(1, positions, *values.shape[2:])
        tensors += [x, one_hot.expand(2, -1, -1, -1).contiguous()]
    return tuple(tensors)


def decoded_indices(grad_input: torch.Tensor, out_sizes) -> torch.Tensor:
    """[N, 1, *out] int64: channel c's one nonzero element's flat position, per window c."""
    batch, positions = grad_input.shape[:2]
    flat = grad_input.reshape(batch, positions, -1)
    chosen = flat != 0
    assert torch.all(chosen.sum(-1) == 1), "a window routed its gradient to no or several elements"
    # The delegate's fp32 output of a 1 reads 1 + 2^-23 (measured); a misrouted sum would be >= 2.
    torch.testing.assert_close(flat[chosen], torch.ones(int(chosen.sum())), rtol=0, atol=1e-6)
    return chosen.int().argmax(-1).reshape(batch, 1, *out_sizes)


def _top_level_targets(edge) -> collections.Counter:
    return collections.Counter(
        getattr(n.target, "__name__", str(n.target))
        for n in edge.exported_program().graph.nodes
        if n.op == "call_function"
    )


def _pool_ops_left(edge) -> int:
    return sum(c for name, c in _top_level_targets(edge).items() if "max_pool2d" in name)


@pytest.mark.parametrize("soc", ["SM8650", "SM8850"])
@pytest.mark.parametrize("kind", ["random", "relu", "few_values"])
def test_forward_indices_equal_torchs(qnn_sdk, soc, kind):
    from qnn_convbwd.toolchain import harness

    configs = list(CONFIGS.values())
    probe = ProbeIndices(configs)
    inputs = probe_inputs(configs, kind, seed=0)
    with integration.capture_qnn_graphs() as graphs:
        compiled = harness.lower_program(torch.export.export(probe, inputs), soc)
    assert harness.delegate_count(compiled.edge) == 1
    assert _pool_ops_left(compiled.edge) == 0, _top_level_targets(compiled.edge)
    ops = collections.Counter(op.op_type for graph in graphs for op in graph)
    undilated = sum(all(d == 1 for d in config[3]) for config in configs)
    assert ops["PoolMax2d"] == undilated
    assert ops["ElementWiseMaximum"] > 0  # the dilated config's values
    outputs = compiled.run(inputs)
    for number, (name, config) in enumerate(CONFIGS.items()):
        x = inputs[2 * number]
        want_values, want_indices = torch.ops.aten.max_pool2d_with_indices(
            x[:, :1], *pool_args(config)
        )
        values, grad_input = outputs[2 * number], outputs[2 * number + 1]
        got = decoded_indices(grad_input, want_values.shape[2:])
        assert torch.equal(got, want_indices), f"{name}: indices differ from torch's"
        # fp16 inside the delegate: the values are the inputs' fp16 roundings, read back
        # into fp32 within about one fp32 ulp (measured 1.2e-7 relative).
        torch.testing.assert_close(
            values,
            torch.broadcast_to(want_values.half().float(), values.shape),
            rtol=1e-6,
            atol=1e-6,
        )
