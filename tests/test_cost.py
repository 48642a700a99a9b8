"""qnn_convbwd_dev.cost: multiply-adds of QNN ops and of the ideal training step.

The MAC formulas are checked against torch's own ``FlopCounterMode`` (2 FLOPs
a multiply-add) on generated configurations, the ideal step against the FLOPs
torch counts for a real forward + backward, and one measured lowering (demo,
frozen backbone) against hand-computed values.
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from qnn_convbwd.integration import QnnOpInfo, QnnTensorInfo
from qnn_convbwd_dev import cost, models


def _tensor(name: str, t: torch.Tensor, kind: str = "QNN_TENSOR_TYPE_NATIVE") -> QnnTensorInfo:
    return QnnTensorInfo(name, kind, tuple(t.shape), t.numel() * 4)


def _op(op_type: str, inputs: list[torch.Tensor], output: torch.Tensor) -> QnnOpInfo:
    return QnnOpInfo(
        "op",
        op_type,
        tuple(_tensor(f"in{i}", t) for i, t in enumerate(inputs)),
        (_tensor("out", output),),
    )


def _torch_macs(fn, *args) -> tuple[int, torch.Tensor]:
    with FlopCounterMode(display=False) as counter:
        out = fn(*args)
    return counter.get_total_flops() // 2, out


def _channels_last(t: torch.Tensor) -> torch.Tensor:
    """NC* -> N*C, QNN's activation layout."""
    return t.permute(0, *range(2, t.dim()), 1)


CONV2D = list(
    itertools.product(
        [1, 2],  # batch
        [(4, 8, 1), (6, 6, 3), (8, 8, 8), (4, 12, 4)],  # (in, out, groups)
        [1, 3, (3, 1)],  # kernel
        [1, 2],  # stride
        [1, 2],  # dilation
    )
)


@pytest.mark.parametrize(("batch", "channels", "kernel", "stride", "dilation"), CONV2D)
def test_conv2d_and_transpose_conv2d_macs_match_torch(batch, channels, kernel, stride, dilation):
    cin, cout, groups = channels
    kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
    x = torch.randn(batch, cin, 9, 10)
    w = torch.randn(cout, cin // groups, kh, kw)
    expected, y = _torch_macs(F.conv2d, x, w, None, stride, 1, dilation, groups)
    depthwise = groups == cin and cout % cin == 0 and groups > 1
    op_type = "DepthWiseConv2d" if depthwise and cin == cout else "Conv2d"
    # QNN Conv2d filter HWIO [kh, kw, in/groups, out]; DepthWiseConv2d [kh, kw, 1, out]
    qnn_filter = w.permute(2, 3, 1, 0)
    op = _op(op_type, [_channels_last(x), qnn_filter], _channels_last(y))
    assert cost.qnn_op_macs(op) == expected

    # The transposed convolution of y back to x's channels, torch weight [in, out/groups, kh, kw]
    wt = torch.randn(cout, cin // groups, kh, kw)
    expected_t, xt = _torch_macs(F.conv_transpose2d, y, wt, None, stride, 1, 0, groups, dilation)
    # QNN TransposeConv2d filter [kh, kw, in, out/groups]
    op = _op("TransposeConv2d", [_channels_last(y), wt.permute(2, 3, 0, 1)], _channels_last(xt))
    assert cost.qnn_op_macs(op) == expected_t


@pytest.mark.parametrize(
    ("channels", "kernel", "stride"),
    [((4, 8, 1), 3, 1), ((4, 4, 2), (3, 1, 1), 2), ((6, 6, 6), 2, (1, 2, 2))],
)
def test_conv3d_and_transpose_conv3d_macs_match_torch(channels, kernel, stride):
    cin, cout, groups = channels
    k = (kernel,) * 3 if isinstance(kernel, int) else kernel
    x = torch.randn(2, cin, 5, 6, 7)
    w = torch.randn(cout, cin // groups, *k)
    expected, y = _torch_macs(F.conv3d, x, w, None, stride, 1, 1, groups)
    op = _op("Conv3d", [_channels_last(x), w.permute(2, 3, 4, 1, 0)], _channels_last(y))
    assert cost.qnn_op_macs(op) == expected

    wt = torch.randn(cout, cin // groups, *k)
    expected_t, xt = _torch_macs(F.conv_transpose3d, y, wt, None, stride, 1, 0, groups)
    op = _op("TransposeConv3d", [_channels_last(y), wt.permute(2, 3, 4, 0, 1)], _channels_last(xt))
    assert cost.qnn_op_macs(op) == expected_t


@pytest.mark.parametrize(("m", "k", "n"), [(1, 8, 10), (4, 576, 10), (7, 3, 7)])
def test_fully_connected_and_matmul_macs_match_torch(m, k, n):
    x, w = torch.randn(m, k), torch.randn(n, k)
    expected, y = _torch_macs(F.linear, x, w)
    assert cost.qnn_op_macs(_op("FullyConnected", [x, w], y)) == expected

    a, b = torch.randn(3, k, m), torch.randn(3, k, n)  # a read transposed (transpose_in0)
    expected, y = _torch_macs(torch.bmm, a.transpose(1, 2), b)
    assert cost.qnn_op_macs(_op("MatMul", [a, b], y)) == expected
    expected, y = _torch_macs(torch.bmm, a.transpose(1, 2).contiguous(), b)
    assert cost.qnn_op_macs(_op("MatMul", [a.transpose(1, 2), b], y)) == expected


def test_ops_that_do_not_multiply_have_no_macs():
    x = torch.randn(1, 4, 4, 8)
    assert cost.qnn_op_macs(_op("ElementWiseMultiply", [x, x], x)) is None
    assert cost.qnn_op_macs(_op("Transpose", [x], x)) is None


@pytest.mark.parametrize(
    ("model", "trainable"),
    [("demo", False), ("demo", True), ("resnet", True), ("mobilenet", False), ("cifar", False)],
)
def test_ideal_equals_torch_flops_of_a_training_step(model, trainable):
    """Forward + backward MACs torch counts (its convolution_backward honours output_mask).

    torch 2.13's FlopCounterMode counts a grouped grad_weight as if groups were 1
    (measured: a 16x1x3x3 depthwise grad_weight counted 16x its forward MACs),
    so that excess is added to ours before comparing.
    """
    case = models.TRAINING_MODELS[model](trainable)
    layers = cost.ideal_macs(case.model, case.inputs)
    with FlopCounterMode(display=False) as counter:
        case.model(*case.inputs).backward()
    modules = dict(case.model.named_modules())
    torch_excess = sum(
        (getattr(modules[layer.name], "groups", 1) - 1) * layer.grad_weight for layer in layers
    )
    assert sum(layer.total for layer in layers) + torch_excess == counter.get_total_flops() // 2
    frozen = {n for n, p in case.model.named_parameters() if not p.requires_grad}
    for layer in layers:
        assert (layer.grad_weight == 0) == (f"{layer.name}.weight" in frozen)


def test_ideal_of_the_demo_by_hand():
    case = models.TRAINING_MODELS["demo"](False)
    by_name = {layer.name: layer for layer in cost.ideal_macs(case.model, case.inputs)}
    # 15x15 input, 8 channels: adapter 1x1 8->8; 3x3 8->16; 3x3 s2 16->16 (8x8 out);
    # 3x3 depthwise 16; 1x1 16->8
    forward = {
        "adapter": 15 * 15 * 8 * 8,
        "backbone.0": 15 * 15 * 16 * 9 * 8,
        "backbone.2": 8 * 8 * 16 * 9 * 16,
        "backbone.4": 8 * 8 * 16 * 9,
        "backbone.6": 8 * 8 * 8 * 16,
    }
    assert {n: layer.forward for n, layer in by_name.items()} == forward
    assert by_name["adapter"].grad_input == 0  # x needs no gradient
    assert by_name["adapter"].grad_weight == forward["adapter"]
    for name in forward.keys() - {"adapter"}:
        assert by_name[name].grad_input == forward[name]  # flows on to the adapter
        assert by_name[name].grad_weight == 0  # frozen


@pytest.fixture(scope="module")
def demo_cost(qnn_sdk):
    return cost.measure(models.TRAINING_MODELS["demo"](False), "SM8650")


def test_measured_demo_macs_by_hand(demo_cost):
    plugin, on_cpu = demo_cost.lowerings
    fwd = 14_400 + 259_200 + 147_456 + 9_216 + 8_192
    assert demo_cost.ideal_total() == fwd + (fwd - 14_400) + 14_400
    assert plugin.backward_delegated == "5 of 5" and not plugin.cpu_macs
    # Conv2d: the forward convs (depthwise apart); the 1x1 adapter's grad_weight is a
    # MatMul (builders/weight_gradient.py), at the ideal count
    assert plugin.qnn_macs["Conv2d"] == fwd - 9_216
    assert plugin.qnn_macs["MatMul"] == 14_400
    assert plugin.qnn_macs["DepthWiseConv2d"] == 9_216
    # grad_input: the stride-2 conv's as four phase TransposeConv2d (Options.stride="phases"),
    # their taps 4 + 2 + 2 + 1 of the 3x3 kernel on the 8x8 grad_output: the ideal count
    assert plugin.qnn_macs["TransposeConv2d"] == 259_200 + 147_456 + 9_216 + 8_192
    # Kept on CPU: the program still holds every convolution_backward, at the ideal count
    assert on_cpu.backward_delegated == "0 of 5"
    assert on_cpu.cpu_macs == {"aten.convolution_backward.out": fwd}
    assert on_cpu.total_macs == demo_cost.ideal_total()


def test_measured_demo_bytes_and_memory(demo_cost):
    plugin, on_cpu = demo_cost.lowerings
    case = models.TRAINING_MODELS["demo"](False)
    frozen = {n: p for n, p in case.model.named_parameters() if not p.requires_grad}
    for low in (plugin, on_cpu):
        assert {w.parameter for w in low.weights} == set(frozen)
        for w in low.weights:
            assert w.size == frozen[w.parameter].numel() * 4  # declared fp32
            assert w.static == w.size  # stored once in the QNN graph, nothing appended
    # runtime_weight stores a weight as two static tensors: the head Concat copies
    # and the 64-element tail the Multiply by the run-time 1.0 reads.
    split = {w.parameter: len(w.tensors) for w in plugin.weights}
    assert split == {n: 2 if n.endswith("weight") else 1 for n in frozen}
    assert all(len(w.tensors) == 1 for w in on_cpu.weights)
    assert plugin.delegates == 1 and on_cpu.delegates > 1
    assert len(plugin.delegate_io) == 1 and len(on_cpu.delegate_io) == on_cpu.delegates
    assert 0 < plugin.planned < on_cpu.planned
    assert "| plugin | HTP | TransposeConv2d | 424,064 |" in cost.to_markdown(demo_cost)


def test_planned_memory_reads_the_forward_plan():
    class Plan:
        def __init__(self, name, sizes):
            self.name, self.non_const_buffer_sizes = name, sizes

    class Program:
        class executorch_program:  # noqa: N801 (executorch's attribute name)
            execution_plan = [Plan("__et_training_x", [0, 5]), Plan("forward", [0, 7, 3])]

    assert cost.planned_memory(Program()) == 10
    weight = cost.WeightBytes("w", (1,), 4, 8, ("0:p_w@0", "2:p_w@0"))
    assert weight.ratio == 2.0 and weight.partitions == 2


def test_cli_prints_the_report(demo_cost, monkeypatch, capsys):
    import argparse

    from qnn_convbwd import cli

    assert cli.COMMANDS["cost"][0] == "qnn_convbwd_dev.cost"
    parser = argparse.ArgumentParser()
    cost.add_arguments(parser)
    args = parser.parse_args(["--model", "demo", "--frozen", "--soc", "SM8650"])
    seen = []

    def measure(case, soc, cpu_baseline):
        seen.append((case.name, soc, cpu_baseline))
        return demo_cost

    monkeypatch.setattr(cost, "measure", measure)
    assert cost.run(args) == 0
    assert seen == [("demo-15px-frozen", "SM8650", True)]
    out = capsys.readouterr().out
    assert "### demo-15px-frozen on SM8650" in out
    assert "* on CPU (backward on CPU): convolution_backward, mean" in out


def _saver_graph(tensors: dict[str, np.ndarray]):
    from qnn_convbwd.toolchain import saver

    float32 = next(code for code, (name, _) in saver.DATA_TYPES.items() if name == "FLOAT_32")
    made = {
        name: saver.SaverTensor(name, "STATIC", float32, a.shape, np.float32(a).tobytes())
        for name, a in tensors.items()
    }
    made["x"] = saver.SaverTensor("x", "APP_WRITE", float32, (1, 4), None)
    ops = [
        saver.SaverOp(f"op_{n}", "Conv2d", "qti.aisw", ["x", n], [f"y_{n}"], {}, []) for n in made
    ]
    for name in list(made):
        if name != "x":
            made[f"y_{name}"] = saver.SaverTensor(f"y_{name}", "NATIVE", float32, (1,), None)
    return saver.SaverGraph("g", made, ops)


def test_weight_copies_finds_a_weights_values_under_any_name_and_layout():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(64, 64, 3), torch.nn.Conv2d(64, 8, 3))
    model[0].requires_grad_(False)
    model[1].weight.requires_grad_(False)  # frozen too, small: not "large"
    with torch.no_grad():  # weights share values: a value alone does not name its weight
        model[1].weight.view(-1)[::2] = model[0].weight.view(-1)[: model[1].weight.numel() // 2]
    big = model[0].weight.detach().numpy()  # 64x64x3x3: 72 KiB in fp16
    small = model[1].weight.detach().numpy()
    flat = np.zeros(18 * 2048 + 2048, np.float32)  # runtime_weight's padded flat tensor
    flat[: big.size] = big.ravel()
    graph = _saver_graph(
        {
            "p_0_weight_flat": flat.reshape(1, -1, 8, 32),
            "some_permute": big.transpose(2, 3, 1, 0),  # a copy under another name
            "phase_taps": big[:, :, ::2, ::2],  # a slice of it
            "p_1_weight": small,
            "unrelated": np.random.default_rng(0).standard_normal((16, 16)),
            "p_0_bias": model[0].bias.detach().numpy(),  # 1-D: not a convolution weight
        }
    )
    found = cost.weight_copies(model, graph)
    by_name = {w.parameter: w for w in found.weights}
    assert set(by_name) == {"0.weight", "1.weight"}
    first = by_name["0.weight"]
    assert {t[0] for t in first.tensors} == {"p_0_weight_flat", "some_permute", "phase_taps"}
    assert first.size == big.size * 4 and first.large and not by_name["1.weight"].large
    assert first.static == (flat.size + big.size + big[:, :, ::2, ::2].size) * 4
    assert first.ratio == pytest.approx(first.static / first.size - 1)
    assert first.coverage == 1.0 and first.readers == 1  # one op reads each tensor
    assert by_name["1.weight"].ratio == 0.0
    assert [name for name, _ in found.unattributed] == ["unrelated", "p_0_bias"]
    assert found.worst() is first


def _zoo_cost():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "zoo_cost.py"
    spec = importlib.util.spec_from_file_location("zoo_cost", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _result(scheme: str, weights: list[dict] | None, soc: str = "SM8650") -> dict:
    lowered = {
        "total_macs": 103,
        "context": 1000,
        "static_bytes": 1600,
        "planned": 10,
        "delegates": 1,
        "backward_delegated": "2 of 2",
        "seconds": 1.0,
    }
    saver = None if weights is None else {"seconds": 2.0, "weights": weights}
    return {
        "arch": "resnet18",
        "scheme": scheme,
        "size": 32,
        "soc": soc,
        "ideal": {"forward": 50, "grad_input": 50, "grad_weight": 0},
        "plugin": lowered,
        "on_cpu": None,
        "saver": saver,
    }


def _weight(name: str, ratio: float, large: bool = True, coverage: float = 1.0) -> dict:
    tensors = [[f"p_{name}", 4, coverage, 1]]
    return {
        "parameter": name,
        "ratio": ratio,
        "large": large,
        "coverage": coverage,
        "readers": 1,
        "tensors": tensors,
    }


def test_weight_copies_joins_a_weight_split_in_two_tensors():
    """runtime_weight stores a weight flat as a head and a 64-element tail: together
    they hold it whole, once, each read by one op."""
    torch.manual_seed(0)
    model = torch.nn.Conv2d(64, 64, 3).requires_grad_(False)
    flat = model.weight.detach().numpy().transpose(2, 3, 1, 0).ravel()  # HWIO, flat
    graph = _saver_graph({"p_weight": flat[None, :-64], "p_weight_runtime_tail": flat[None, -64:]})
    (weight,) = cost.weight_copies(model, graph).weights
    assert len(weight.tensors) == 2 and max(t[2] for t in weight.tensors) < 1
    assert weight.coverage == 1.0 and weight.readers == 1 and weight.ratio == 0.0


def test_zoo_cost_rows_judge_the_worst_large_weight(tmp_path):
    zoo_cost = _zoo_cost()
    rows = [
        _result("adapter", [_weight("net.a", 0.01), _weight("net.b", 0.2, large=False)]),
        _result("bias_only", [_weight("net.a", 0.06), {**_weight("net.d", 0.0), "readers": 2}]),
        _result("full", None),
        _result("adapter", [_weight("net.a", 0.0, coverage=0.5), _weight("net.c", 0.0)], "SM8850"),
    ]
    path = tmp_path / "cost.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = zoo_cost.table(path).splitlines()
    assert lines[0] == zoo_cost.HEADER and len(lines) == 2 + len(rows)
    adapter, bias_only, full, sm8850 = lines[2:]
    assert "| **1.030** (103 / 100) | 1 | 1 (1) | 0.010 (a) | yes |" in adapter
    assert "| 0.060 (a) | **no**; 1 read by more than one op |" in bias_only
    assert "| 0 | - | - | yes |" in full and full.endswith("| 1 / - / - |")
    assert "| 0.000 (each) | yes; not found whole by value: a |" in sm8850
    assert "| 1,000 / - | 200 (0.250) |" in adapter  # context - static / 2


def test_zoo_cost_file_holds_one_line_per_row(tmp_path):
    """--json replaces the row's line; a file with two lines for one row is refused."""
    zoo_cost = _zoo_cost()
    path = tmp_path / "cost.jsonl"
    first = _result("adapter", [_weight("net.a", 0.01)])
    zoo_cost.write(path, first)
    zoo_cost.write(path, _result("full", None))
    redone = _result("adapter", [_weight("net.a", 0.02)])
    zoo_cost.write(path, redone)
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        redone,
        _result("full", None),
    ]
    path.write_text(path.read_text() + json.dumps(first) + "\n")
    with pytest.raises(ValueError, match=r":3: a second line for \('resnet18', 'adapter'"):
        zoo_cost.table(path)


def test_zoo_cost_table_columns_by_measurement(tmp_path):
    """--columns saver: the Saver recording's columns; htp: only rows an HTP lowering measured."""
    zoo_cost = _zoo_cost()
    saver_only = _result("bias_only", [_weight("net.a", 0.0)], "SM8850")
    saver_only["plugin"] = None
    saver_only["saver"]["qnn_macs"] = {"Conv2d": 100}
    path = tmp_path / "cost.jsonl"
    for result in (_result("adapter", [_weight("net.a", 0.01)]), saver_only):
        zoo_cost.write(path, result)
    header, _, adapter, bias_only = zoo_cost.table(path, "saver").splitlines()
    assert header.endswith("| <= 0.05 | Saver s |") and "context" not in header
    assert adapter.endswith("| 0.010 (a) | yes | 2 |")
    assert "| **1.000** (100 / 100) |" in bias_only and bias_only.endswith("| yes | 2 |")
    header, _, adapter = zoo_cost.table(path, "htp").splitlines()  # no SM8850 row
    assert "MACs" not in header and header.endswith("| lowering s: plugin / CPU |")
    assert adapter.endswith("| 1 / - | 2 of 2 | 1 / - |")
    assert zoo_cost.table(path).splitlines()[0] == zoo_cost.HEADER


def test_saver_op_macs_reads_the_recorded_dims():
    from qnn_convbwd.toolchain import saver

    def tensor(name, dims, kind="NATIVE"):
        return saver.SaverTensor(name, kind, 562, dims, None)

    tensors = {
        t.name: t
        for t in (
            tensor("x", (1, 8, 8, 4), "APP_WRITE"),
            tensor("w", (3, 3, 4, 8), "STATIC"),
            tensor("y", (1, 8, 8, 8)),
            tensor("z", (1, 8, 8, 8), "APP_READ"),
        )
    }
    ops = [
        saver.SaverOp("conv", "Conv2d", "qti.aisw", ["x", "w"], ["y"], {}, []),
        saver.SaverOp("relu", "Relu", "qti.aisw", ["y"], ["z"], {}, []),
    ]
    macs = cost.saver_op_macs(saver.SaverGraph("g", tensors, ops))
    assert macs == {"Conv2d": 8 * 8 * 8 * 3 * 3 * 4}
