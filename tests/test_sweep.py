"""qnn_convbwd_dev.sweep: the kinds of ops on CPU, the table, and (slow) one model swept."""

from __future__ import annotations

import copy
import json
import statistics

import pytest
import torch

from qnn_convbwd.api import CpuOp
from qnn_convbwd.partition import verdict
from qnn_convbwd.torchvision_import import TorchvisionUnavailable
from qnn_convbwd_dev import reference_kernels, sweep


def test_every_named_rule_is_a_registered_rule():
    registered = {name for _, name in verdict.registered()}
    assert sweep.STATE_RULES <= registered
    assert sweep.FOLLOWS_RULES <= registered
    assert not sweep.STATE_RULES & sweep.FOLLOWS_RULES


def test_ops_on_cpu_are_counted_by_kind_rule_and_op():
    on_cpu = [
        CpuOp("a", "aten.mul.Tensor", "program_state_on_cpu", ""),
        CpuOp("b", "aten.mul.Tensor", "program_state_on_cpu", ""),
        CpuOp("c", "aten.full.default", "constant_follows_consumers", ""),
        CpuOp("d", "aten.erf.default", "no_visitor", ""),
        CpuOp("e", "aten.native_layer_norm.default", "trainable_parameter_baked", ""),
    ]
    counted = sweep.count_on_cpu(on_cpu)
    assert counted == {
        "state": {"program_state_on_cpu aten.mul.Tensor": 2},
        "follows": {"constant_follows_consumers aten.full.default": 1},
        "gap": {
            "no_visitor aten.erf.default": 1,
            "trainable_parameter_baked aten.native_layer_norm.default": 1,
        },
    }


def test_the_table_spells_out_the_gaps_and_the_json_keeps_the_rows(tmp_path):
    counted = sweep.count_on_cpu(
        [
            CpuOp("d", "aten.erf.default", "no_visitor", ""),
            CpuOp("f", "aten.erf.default", "no_visitor", ""),
            CpuOp("a", "aten.mul.Tensor", "program_state_on_cpu", ""),
        ]
    )
    rows = [
        sweep.Row("convnext_tiny", "full", 32, 4, "SM8650", "decide", 1.0, 2.0, counted),
        sweep.Row("vgg11_bn", "full", 0, 0, "SM8650", "", 0.0, 0.0, {}, error="Boom: why"),
    ]
    table = sweep.markdown(rows).splitlines()
    assert table[2].startswith("| convnext_tiny | full | 32 | decide | 2 | - | 1 | 0 | 2 |")
    assert "2 `aten.erf.default` (no_visitor)" in table[2]
    assert "not swept: Boom: why" in table[3]
    md, js = sweep.write(rows, tmp_path / "out")
    assert md.read_text().splitlines() == table
    back = json.loads(js.read_text())
    assert back[0]["on_cpu"]["gap"] == {"no_visitor aten.erf.default": 2}
    assert back[1]["error"] == "Boom: why"


def test_smallest_size_is_the_first_size_the_model_takes():
    try:
        assert sweep.smallest_size("resnet18") == 32
        assert sweep.smallest_size("squeezenet1_1", at_least=40) == 48  # no 40 in the list
    except TorchvisionUnavailable as err:
        pytest.skip(str(err))


def test_googlenet_trains_without_its_auxiliary_heads():

    try:
        net, x, y = sweep.train_mode_batch("googlenet", "full", 2, 32)
    except TorchvisionUnavailable as err:
        pytest.skip(str(err))
    assert net.training
    out = net(x)
    assert isinstance(out, torch.Tensor) and out.shape == (2, 10)


def test_the_full_scheme_trains_every_parameter_even_without_a_linear_head():
    try:
        net, _, _ = sweep.train_mode_batch("squeezenet1_1", "full", 2, 32)
    except TorchvisionUnavailable as err:
        pytest.skip(str(err))
    assert all(p.requires_grad for p in net.parameters())
    assert not any(isinstance(m, torch.nn.Linear) for m in net.modules())


def test_stepped_models_draw_no_stochastic_depth_masks():
    """Steps compared with torch's take the model without stochastic depth's draws (torch
    and the program would drop different blocks); decide() keeps them, in train()."""
    try:
        stepped, x, _ = sweep.train_mode_batch(
            "efficientnet_b0", "full", 2, 32, stochastic_depth=False
        )
        decided, _, _ = sweep.train_mode_batch("efficientnet_b0", "full", 2, 32)
    except TorchvisionUnavailable as err:
        pytest.skip(str(err))
    kinds = [type(m).__name__ for m in stepped.modules()]
    assert kinds.count("StochasticDepth") == 16
    depth = [m for m in stepped.modules() if type(m).__name__ == "StochasticDepth"]
    assert not any(m.training for m in depth) and stepped.training
    assert all(m.training for m in decided.modules() if type(m).__name__ == "StochasticDepth")
    with torch.no_grad():  # no draw left: two passes agree (batch statistics, same batch)
        assert torch.equal(stepped(x), stepped(x))


@pytest.mark.slow(reason="a decide() of resnet18's joint graph takes about a minute")
def test_resnet18_decide_leaves_only_the_program_state_on_cpu():
    row = sweep.sweep_one("resnet18", "full", size=32, batch=2)
    assert row.how == "decide" and row.error is None
    assert row.count("gap") == 0 and row.count("follows") == 0
    assert row.count("state") > 0  # the running statistics' updates


@pytest.mark.slow(reason="lowers resnet18 (last layers) and takes two simulator SGD steps")
def test_lower_and_step_match_torch(qnn_sdk):
    """At batch 2 and 32 px resnet18's last stage normalises two values per channel
    (1x1 maps): torch fp16 itself gets a gradient there 89 % wrong and the loss is as
    ill-conditioned, so the gradients are judged against torch fp16's own error, in
    median and at worst."""
    row = sweep.sweep_one("resnet18", "last-layers", size=32, batch=2, lower=True, steps=2)
    assert row.delegates == 1 and row.count("gap") == 0
    assert len(row.step["losses"]) == len(row.step["torch_losses"]) == 2
    assert row.step["gradients"] == 17
    assert row.step["median_ratio"] <= 2.0
    assert row.step["worst_error"] <= 2 * row.step["worst_fp16_error"] + 1e-3


def test_the_torch_reference_steps_are_torch_optim_sgd():
    """The sweep's torch side of its SGD steps is torch.optim.SGD to the bit, batch-norm
    statistics of train() included, and it leaves the model it copies untouched."""
    net, x, y = _tiny()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    losses, first = sweep._torch_steps(net, x, y, 3, 0.1, torch.float32)
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())

    model = copy.deepcopy(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    expected = []
    for index in range(3):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        expected.append(float(loss))
        if index == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
    assert losses == expected
    assert first.keys() == grads.keys()
    assert all(torch.equal(first[n], grads[n]) for n in grads)


def _tiny() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3),
        torch.nn.BatchNorm2d(4),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(4 * 6 * 6, 10),
    ).train()
    return net, torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))


@pytest.mark.parametrize("how", sweep.PERTURBATIONS)
def test_a_loss_spread_of_size_zero_is_the_reference_steps_to_the_bit(how):
    """Unperturbed, the spread's reference and every draw are the sweep's torch steps;
    moved by one fp16 rounding, the last step's loss moves (the first only when its
    forward is moved: the batch or activations)."""
    net, x, y = _tiny()
    only = ("1",) if how == "activations" else ()
    with reference_kernels.pinned():
        losses, _ = sweep._torch_steps(net, x, y, 3, 0.1, torch.float32)
    still = sweep.loss_spread(net, x, y, how, steps=3, lr=0.1, draws=3, only=only, size=0.0)
    assert still.reference == losses
    assert still.draws == [losses] * 3 and still.maximum(2) == 0.0
    moved = sweep.loss_spread(net, x, y, how, steps=3, lr=0.1, draws=3, only=only)
    assert moved.reference == losses
    assert 0.0 < moved.median(2) <= moved.maximum(2) < 0.1
    assert (moved.maximum(0) > 0.0) == (how in ("inputs", "activations"))
    assert len({tuple(d) for d in moved.draws}) == 3  # each draw its own


def test_the_inputs_spread_steps_on_fidelitys_neighbours():
    from qnn_convbwd_dev import fidelity

    net, x, y = _tiny()
    spread = sweep.loss_spread(net, x, y, "inputs", steps=2, lr=0.1, draws=2, seed=5)
    batches = [b for (b,) in fidelity.neighbours((x,), 3, seed=5)]
    with reference_kernels.pinned():
        expected = [sweep._torch_steps(net, b, y, 2, 0.1, torch.float32)[0] for b in batches]
    assert [spread.losses(s) for s in (0, 1)] == [[e[s] for e in expected] for s in (0, 1)]
    assert spread.deviations(1) == [abs(e[1] - expected[0][1]) for e in expected[1:]]


def test_perturbed_gradients_and_weights_stay_in_the_named_parameters():
    """Moving only the head's gradients or weights leaves the convolution's update exact."""
    net, x, y = _tiny()
    for how in ("gradients", "weights"):
        perturbation = sweep._Perturbation(how, 2.0**-11, ("4",), torch.Generator().manual_seed(0))
        plain, moved = copy.deepcopy(net), copy.deepcopy(net)
        for model, p in ((plain, None), (moved, perturbation)):
            hooks = p.install(model) if p is not None else []
            assert hooks == []
            torch.nn.functional.cross_entropy(model(x), y).backward()
            with torch.no_grad():
                for name, w in model.named_parameters():
                    grad = w.grad if p is None else p.gradient(name, w.grad)
                    w.add_(grad, alpha=-0.1)
                    w.copy_(w if p is None else p.weight(name, w))
        after = dict(moved.named_parameters())
        for name, w in plain.named_parameters():
            relative = float(((after[name] - w).abs() / w.abs().clamp_min(1e-30)).max())
            if name.startswith("4."):
                assert 0.0 < relative < (2.0**-11 if how == "weights" else 1.0), name
            else:
                assert relative == 0.0, name


def test_a_loss_spread_names_what_it_cannot_perturb():
    net, x, y = _tiny()
    with pytest.raises(ValueError, match="unknown perturbation 'biases'"):
        sweep.loss_spread(net, x, y, "biases")
    with pytest.raises(ValueError, match=r"no module or parameter of the model is named \['9'\]"):
        sweep.loss_spread(net, x, y, "gradients", only=("9",))
    with pytest.raises(ValueError, match="name the modules"):
        sweep.loss_spread(net, x, y, "activations")
    with pytest.raises(ValueError, match="need 2 steps"):
        sweep.loss_spread(net, x, y, "weights", steps=1)


def test_step_noise_sets_fp16s_gaps_over_the_neighbours_against_the_bounds():
    from qnn_convbwd_dev import step_floor

    net, x, y = _tiny()
    threads = torch.get_num_threads()
    rows = sweep.step_noise(net, x, y, steps=2, lr=0.1, draws=4, seed=1)
    assert torch.get_num_threads() == threads  # the caller's settings are back
    with reference_kernels.pinned():
        fp32, _ = sweep._torch_steps(net, x, y, 2, 0.1, torch.float32)
    with reference_kernels.fp16_kernels():
        fp16, _ = sweep._torch_steps(net, x, y, 2, 0.1, torch.float16)
    assert [r["fp32"] for r in rows] == fp32
    assert [r["fp16_gap"] for r in rows] == [abs(h - f) for h, f in zip(fp16, fp32)]
    spread = sweep.loss_spread(net, x, y, "inputs", steps=2, lr=0.1, draws=3, seed=1)
    for step, r in enumerate(rows):
        assert r["fp16_min"] <= min(r["fp16_gap"], r["fp16_median"]) <= r["fp16_max"]
        assert (r["fp32_median"], r["fp32_max"]) == (spread.median(step), spread.maximum(step))
        assert r["one_draw_bound"] == step_floor.loss_bound(r["fp32"], r["fp16_gap"])
        typical = statistics.median(spread.losses(step))
        assert r["bound"] == step_floor.loss_bound(typical, r["fp16_median"])
        assert 0.0 <= r["pass_fraction"] <= 1.0
    table = sweep.noise_markdown("tiny", rows).splitlines()
    assert len(table) == 6 and table[-1].startswith(f"| 2 | {fp32[1]:.4f} |")
    with pytest.raises(ValueError, match="at least one neighbour"):
        sweep.step_noise(net, x, y, draws=1)


def test_neighbour_gradients_update_with_the_gradients_of_a_neighbour_of_the_batch():
    """The second loss under ``neighbour_gradients`` is the loss on the batch after an
    update made with the neighbour's gradients (in the named parameters only)."""
    from qnn_convbwd_dev import fidelity

    net, x, y = _tiny()
    (moved,) = fidelity.neighbours((x,), 2, seed=3)[1]
    for only in ((), ("0",)):
        spread = sweep.loss_spread(
            net, x, y, "neighbour_gradients", steps=2, lr=0.1, draws=1, seed=3, only=only
        )
        theirs, ours = copy.deepcopy(net), copy.deepcopy(net)
        with reference_kernels.pinned():
            torch.nn.functional.cross_entropy(theirs(moved), y).backward()
            torch.nn.functional.cross_entropy(ours(x), y).backward()
            grads = dict(theirs.named_parameters())
            with torch.no_grad():
                for name, p in ours.named_parameters():
                    taken = grads[name].grad if not only or name.startswith("0.") else p.grad
                    p.add_(taken, alpha=-0.1)
            expected = float(torch.nn.functional.cross_entropy(ours(x), y))
        assert spread.draws[0][1] == expected
        assert spread.draws[0][0] == spread.reference[0]  # the first step's forward is the batch's
        assert spread.draws[0][1] != spread.reference[1]
