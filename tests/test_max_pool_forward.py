"""The forward max_pool2d_with_indices on the HTP with its indices.

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
import copy
import functools
import logging

import pytest
import torch
from tiers import sweep
from torch import nn

from qnn_convbwd import integration
from qnn_convbwd.partition import max_pool
from qnn_convbwd_dev.pool_bank import PoolBank, pool_args

BACKWARD = "max_pool2d_with_indices_backward"
FORWARD = "max_pool2d_with_indices"

# (kernel, stride, padding, dilation, ceil_mode, input size)
CONFIGS = {
    "k2s2": ((2, 2), (2, 2), (0, 0), (1, 1), False, (8, 8)),
    "k3s2p1": ((3, 3), (2, 2), (1, 1), (1, 1), False, (9, 9)),
    "k3s2_ceil": ((3, 3), (2, 2), (0, 0), (1, 1), True, (10, 10)),
    "k3s1p1_d2": ((3, 3), (1, 1), (1, 1), (2, 2), False, (7, 7)),
    # The last window reads the right padding column: QAIRT's PoolMax2d after a Pad
    # computes it wrongly there (docs/htp_defects.md); the values are a Maximum chain.
    "k2s2p1": ((2, 2), (2, 2), (1, 1), (1, 1), False, (8, 8)),
}


def plane(kind: str, size, seed: int) -> torch.Tensor:
    """One input plane [1, 1, H, W]: random, or tie-heavy (ReLU'd, or few values)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 1, *size, generator=generator)
    if kind == "relu":  # about half exact zeros, as after a ReLU
        return torch.relu(x)
    if kind == "few_values":  # quantised to 3 levels: ties everywhere
        return torch.clamp(torch.round(x), -1, 1)
    return x


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


def _forward_pools_on_cpu(edge) -> int:
    """Top-level forward pools (``.default``, or ``.out`` once to_executorch ran)."""
    return sum(
        c
        for name, c in _top_level_targets(edge).items()
        if name.removeprefix("aten.").split(".")[0] == FORWARD
    )


def _pool_ops_left(edge) -> int:
    return sum(c for name, c in _top_level_targets(edge).items() if "max_pool2d" in name)


@functools.cache
def _probe_lowered(soc: str):
    """The probe of every config, lowered once per SoC: the input kinds share its shapes."""
    from qnn_convbwd.toolchain import harness

    configs = list(CONFIGS.values())
    probe = PoolBank(configs, with_values=True)  # the values and grad_input per config
    with integration.capture_qnn_graphs() as graphs:
        program = torch.export.export(probe, probe_inputs(configs, "random", seed=0))
        compiled = harness.lower_program(program, soc)
    return compiled, graphs


@pytest.mark.parametrize("soc", sweep(["SM8650"], ["SM8850"]))  # V75; V81 with --slow
@pytest.mark.parametrize("kind", ["random", "relu", "few_values"])
def test_forward_indices_equal_torchs(qnn_sdk, soc, kind):
    from qnn_convbwd.toolchain import harness

    configs = list(CONFIGS.values())
    inputs = probe_inputs(configs, kind, seed=0)
    compiled, graphs = _probe_lowered(soc)
    assert harness.delegate_count(compiled.edge) == 1
    assert _pool_ops_left(compiled.edge) == 0, _top_level_targets(compiled.edge)
    ops = collections.Counter(op.op_type for graph in graphs for op in graph)
    # PoolMax2d only for the pool that is neither dilated nor padded (by its padding or
    # by ceil_mode's last window); the others' values are k * k - 1 Maximum ops each.
    plain = {"k2s2"}
    assert ops["PoolMax2d"] == len(plain)
    chained = [config[0][0] * config[0][1] - 1 for n, config in CONFIGS.items() if n not in plain]
    assert ops["ElementWiseMaximum"] == sum(chained)
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


# --- training graphs --------------------------------------------------------------------


class ConvPoolNet(nn.Module):
    """Conv -> ReLU -> MaxPool -> Conv -> ReLU -> MaxPool -> Linear, MSE; all trains."""

    def __init__(self, config) -> None:
        super().__init__()
        self.args = pool_args(config)
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.LazyLinear(4)

    def pool(self, y):
        return nn.functional.max_pool2d(y, *self.args[:4], ceil_mode=self.args[4])

    def features(self, x):
        y = self.pool(torch.relu(self.conv1(x)))
        return self.pool(torch.relu(self.conv2(y))).flatten(1)

    def forward(self, x, target):
        return nn.functional.mse_loss(self.fc(self.features(x)), target)


def conv_pool_graph(config_name: str):
    from torch.export.experimental import _export_forward_backward

    from qnn_convbwd_dev import models

    torch.manual_seed(0)
    config = CONFIGS[config_name]
    model = ConvPoolNet(config)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        model.fc(model.features(x))  # materialise the lazy layer
        target = torch.randn(2, 4)
    joint = _export_forward_backward(torch.export.export(model, (x, target), strict=True))
    return models.TrainingGraph(config_name, model, (x, target), joint)


@pytest.mark.parametrize("config_name", ["k2s2", "k3s2p1", "k3s2_ceil"])
def test_training_graph_is_one_delegate_within_fidelity(qnn_sdk, config_name):
    """Forward pools, their indices and backwards, convolutions and their backwards:
    all in one delegate, every gradient within fidelity of torch."""
    from qnn_convbwd.toolchain import harness
    from qnn_convbwd_dev import fidelity

    graph = conv_pool_graph(config_name)
    compiled = harness.lower_program(graph.program, "SM8650")
    assert harness.delegate_count(compiled.edge) == 1
    assert _pool_ops_left(compiled.edge) == 0, _top_level_targets(compiled.edge)
    outputs = compiled.run(list(graph.inputs))
    report = fidelity.assess_model(graph.model, graph.inputs, graph.program, outputs)
    assert report.within, report.to_markdown()


def _forward_lines(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == max_pool.__name__ and r.getMessage().startswith(f"{FORWARD} ")
    ]


def test_backward_kept_on_cpu_keeps_the_forward_on_cpu(qnn_sdk, caplog):
    """executorch's skip options keep the backward on CPU: its indices would leave the
    delegate, so the forward stays on CPU too (one log line), and the step is right."""
    from qnn_convbwd.toolchain import harness
    from qnn_convbwd_dev import fidelity

    graph = conv_pool_graph("k3s2p1")
    with caplog.at_level(logging.INFO, logger="qnn_convbwd"):
        compiled = harness.lower_program(
            graph.program, "SM8650", skip_node_op_set={f"aten.{BACKWARD}.default"}
        )
    assert _forward_pools_on_cpu(compiled.edge) == 2, _top_level_targets(compiled.edge)
    lines = _forward_lines(caplog)
    assert len(lines) == 2 and all(
        "not delegated: indices read by a backward that stays on CPU (backward=" in line
        for line in lines
    ), lines
    outputs = compiled.run(list(graph.inputs))
    report = fidelity.assess_model(graph.model, graph.inputs, graph.program, outputs)
    assert report.within, report.to_markdown()


class IndicesOut(nn.Module):
    """A pool whose indices are a program output as well as its backward's input."""

    def __init__(self, config_name: str) -> None:
        super().__init__()
        self.args = pool_args(CONFIGS[config_name])

    def forward(self, x, g):
        values, indices = torch.ops.aten.max_pool2d_with_indices(x, *self.args)
        grad = torch.ops.aten.max_pool2d_with_indices_backward(g, x, *self.args, indices)
        return values, indices, grad


PADDED_PLANE_OUTPUT = pytest.mark.xfail(
    strict=True,
    reason="executorch 1.5.1's RecomposePadMaxPool2d makes a padded pool count its indices "
    "in the -inf padded plane; a program that returns them returns those (measured: "
    "11x11-plane indices for a 9x9 input). The plugin corrects the plane for backwards only.",
)


@pytest.mark.parametrize("config_name", ["k2s2", pytest.param("k3s2p1", marks=PADDED_PLANE_OUTPUT)])
def test_indices_read_on_cpu_keep_the_forward_on_cpu(qnn_sdk, caplog, config_name):
    from qnn_convbwd.toolchain import harness

    config = CONFIGS[config_name]
    module = IndicesOut(config_name)
    x = torch.relu(torch.randn(2, 4, *config[5]))
    values, _ = torch.ops.aten.max_pool2d_with_indices(x, *pool_args(config))
    g = torch.randn_like(values)
    with caplog.at_level(logging.INFO, logger="qnn_convbwd"):
        compiled = harness.lower_program(torch.export.export(module, (x, g)), "SM8650")
    assert _forward_pools_on_cpu(compiled.edge) == 1
    (line,) = _forward_lines(caplog)
    assert "not delegated: indices read by an op other than its backward (output:" in line, line
    got = compiled.run([x, g])
    want = module(x, g)
    assert got[1].dtype == torch.int64 and torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(got[2], want[2], rtol=1e-3, atol=1e-3)


def test_v68_keeps_the_forward_on_cpu(qnn_sdk, caplog):
    """Below V69 the backward stays on CPU (float Select), and with it the forward."""
    from qnn_convbwd.toolchain import harness

    graph = conv_pool_graph("k3s2p1")
    # V68 fails to compile this graph's float Select and Sub (docs/max_pool.md):
    # only the pools are left to the partitioner's choice.
    with caplog.at_level(logging.INFO, logger="qnn_convbwd"):
        compiled = harness.lower_program(
            graph.program,
            "SM8350",
            skip_node_op_set=_every_op_but_pools(graph.program),
        )
    assert _forward_pools_on_cpu(compiled.edge) == 2
    lines = _forward_lines(caplog)
    assert len(lines) == 2 and all(
        "not delegated: HTP arch below V69" in line and "(soc=SM8350, arch=V68)" in line
        for line in lines
    ), lines
    outputs = compiled.run(list(graph.inputs))
    for got, want in zip(outputs, graph.reference()):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def _every_op_but_pools(program) -> set[str]:
    from executorch.exir import to_edge

    names = {
        node.target.__name__
        for node in to_edge(program).exported_program().graph.nodes
        if node.op == "call_function" and hasattr(node.target, "_op")
    }
    names.add("aten.constant_pad_nd.default")  # made by RecomposePadMaxPool2d
    return names - {f"aten.{FORWARD}.default", f"aten.{BACKWARD}.default"}


def test_cifar_training_graph_is_one_delegate_within_fidelity(cifar_on_sm8650):
    """ExecuTorch's CIFAR10Model with cross-entropy: three pools with their indices and
    the loss tail (``full_reductions``) in one delegate; left on CPU only the permutes
    of the trained convolution weights to the filter layout and of their gradients back
    (the default ``weight_layout="hwio"``). (The lowering is shared with
    test_training.py's training of the same program.)"""
    from qnn_convbwd import api
    from qnn_convbwd.commands.train_cli import cpu_ops
    from qnn_convbwd.toolchain import harness
    from qnn_convbwd_dev import fidelity

    case, program, compiled = cifar_on_sm8650(True)
    transformed = api.transformed(program, harness.compile_specs("SM8650"))
    compared = [
        a.meta["val"].dtype
        for n in transformed.graph.nodes
        if n.op == "call_function" and getattr(n.target, "__name__", "") == "aten.ne.Tensor"
        for a in n.args
    ]
    assert compared and set(compared) == {torch.int32}  # ignore_index not turned float
    assert harness.delegate_count(compiled.edge) == 1
    assert cpu_ops(compiled.edge) == ["permute_copy"]
    assert {op.rule for op in compiled.report.on_cpu} == {"weight_layout_on_cpu"}
    weights = [p for p in case.model.parameters() if p.requires_grad and p.dim() == 4]
    assert len(compiled.report.on_cpu) == 2 * len(weights), compiled.report.on_cpu_markdown()
    outputs = compiled.run(list(case.inputs))
    report = fidelity.assess_model(case.model, case.inputs, program, outputs)
    assert report.within, report.to_markdown()


class CrossEntropy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 10)

    def forward(self, x, labels):
        return nn.functional.cross_entropy(self.fc(x), labels)


def _run_graph(program, inputs) -> list[torch.Tensor]:
    """The program's graph on ``inputs``, its parameters and constants (flat outputs)."""
    user_inputs = iter(inputs)
    args = []
    for spec in program.graph_signature.input_specs:
        if spec.kind.name == "USER_INPUT":
            args.append(next(user_inputs))
        elif spec.kind.name == "PARAMETER":
            args.append(program.state_dict[spec.target])
        else:
            args.append(program.constants[spec.target])
    return list(torch.fx.Interpreter(program.graph_module).run(*args))


def test_full_reductions_name_their_dims_and_keep_the_numbers():
    """The rewrite on a cross-entropy joint graph: no sum over ``[]`` is left and the count
    is summed in float; loss and gradients unchanged. (The ignore_index constant is a
    lifted tensor only after executorch's QNN passes: see the CIFAR test.)"""
    from executorch.exir import to_edge
    from torch.export.experimental import _export_forward_backward

    from qnn_convbwd.passes import full_reductions

    torch.manual_seed(0)
    model = CrossEntropy()
    inputs = (torch.randn(4, 6), torch.tensor([1, -100, 3, 9]))

    joint = _export_forward_backward(torch.export.export(model, inputs, strict=True))

    def sums(graph):
        return [
            n
            for n in graph.nodes
            if n.op == "call_function" and "sum.dim_IntList" in getattr(n.target, "__name__", "")
        ]

    reference = to_edge(joint).exported_program()
    edge = copy.deepcopy(reference)  # rewritten; the reference keeps the original graph
    module = edge.graph_module
    assert sum(not n.args[1] for n in sums(module.graph)) == 2  # the pattern is there
    assert full_reductions.explicit_full_reductions(module) == 2
    assert all(n.args[1] and n.args[2] for n in sums(module.graph))
    assert all(n.args[0].meta["val"].is_floating_point() for n in sums(module.graph))
    for got, want in zip(_run_graph(edge, inputs), _run_graph(reference, inputs), strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.htp
@pytest.mark.xfail(
    strict=True,
    reason="QAIRT's PoolMax2d reading a Pad's output computes the last column of a 2x2, "
    "stride 2, padding 1 pool on an even width from values outside its windows "
    "(QAIRT 2.51: 34 of 648 values wrong, up to 4.0)",
)
def test_executorch_lowers_a_padded_two_by_two_max_pool_right(qnn_sdk):
    """Canary (plugin off): executorch's own lowering of a values-only pool, its padding
    an explicit Pad (RecomposePadMaxPool2d) before PoolMax2d. XPASSes when QAIRT
    computes it right; until then the plugin takes a pool's values from a Maximum chain
    wherever a Pad feeds it (the k2s2p1 config above, and the values-only pools of
    ``test_values_only_padded_pool_matches_torch``)."""
    import qnn_convbwd
    from qnn_convbwd.toolchain import harness

    module = nn.MaxPool2d(2, 2, 1)
    x = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    assert not qnn_convbwd.is_enabled()
    out = harness.lower_module(module, (x,), "SM8650").run([x])[0]
    # fp16 inside the delegate: the maximum is one of the inputs, rounded to fp16.
    torch.testing.assert_close(out, module(x).half().float(), rtol=1e-6, atol=1e-6)


def _values_only_model(pool: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), pool).eval()


@pytest.mark.parametrize(
    ("pool", "size", "maximum_chain"),
    [
        # The defective geometry: 2x2, stride 2, padding 1 on an even width. Through
        # executorch's PoolMax2d, 56 of 1296 values are wrong here (up to 1.37); at 8x8
        # after this ReLU the wrong reads happened to give the right maxima.
        pytest.param(nn.MaxPool2d(2, 2, 1), (16, 16), True, id="k2s2p1_even"),
        # An odd width reads a Pad too: the same chain, right.
        pytest.param(nn.MaxPool2d(2, 2, 1), (15, 15), True, id="k2s2p1_odd"),
        # No Pad: executorch's PoolMax2d.
        pytest.param(nn.MaxPool2d(2, 2), (16, 16), False, id="k2s2_unpadded"),
    ],
)
def test_values_only_padded_pool_matches_torch(qnn_sdk, plugin, pool, size, maximum_chain):
    """An inference pool (no indices used) whose input is RecomposePadMaxPool2d's Pad
    takes its values from the Maximum chain, not PoolMax2d; an unpadded one keeps
    PoolMax2d. The values equal torch's (fp16 delegate: tolerance of an fp16 conv)."""
    from qnn_convbwd.toolchain import harness

    model = _values_only_model(pool)
    x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(1))
    with integration.capture_qnn_graphs() as graphs:
        # finetune's infer.pte path: executorch's lowering with the plugin enabled.
        compiled = harness.lower_module(model, (x,), "SM8650")
    assert harness.delegate_count(compiled.edge) == 1
    assert _pool_ops_left(compiled.edge) == 0
    got = compiled.run([x])[0]
    torch.testing.assert_close(got, model(x), rtol=1e-2, atol=1e-2)
    ops = collections.Counter(op.op_type for graph in graphs for op in graph)
    assert (ops["PoolMax2d"] == 0) == maximum_chain, ops
    assert (ops["ElementWiseMaximum"] > 0) == maximum_chain, ops
