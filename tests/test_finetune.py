"""``qnn_convbwd.finetune`` and ``qnn-convbwd finetune``: digits, schemes, fit next to torch.

The quick tier trains a small ConvBn classifier on 8x8 digits (its own size) for a
few steps; the slow tier trains ExecuTorch's CIFAR-10 example on the simulator.
"""

from __future__ import annotations

import pytest
import torch
from test_finetune_tool import small_model
from torch import nn

from qnn_convbwd import cli, finetune, training
from qnn_convbwd.torchvision_import import TorchvisionUnavailable


def small_net(seed: int = 0) -> nn.Module:
    """test_finetune_tool's small model without dropout (so both sides compute the same
    step), from ``seed``: batch norm in train mode."""
    torch.manual_seed(seed)
    return small_model(10, dropout=None)


def dropout_net(seed: int = 0) -> nn.Module:
    """``small_net`` with dropout 0.5 before its head."""
    net = small_net(seed)
    net.insert(8, nn.Dropout(0.5))
    return net


@pytest.fixture(scope="module")
def digits8():
    return finetune.digits(size=8)


# --- digits ---------------------------------------------------------------------------


def test_digits_split_sizes_and_values():
    from sklearn.datasets import load_digits

    data = finetune.digits(size=32, seed=0)
    (x, y), (tx, ty) = data.train, data.test
    assert x.shape == (1500, 3, 32, 32) and tx.shape == (297, 3, 32, 32)
    assert y.dtype == torch.int64 and y.shape == (1500,) and ty.shape == (297,)
    assert 0.0 <= float(x.min()) and float(x.max()) <= 1.0
    assert torch.equal(x[:, 0], x[:, 1]) and torch.equal(x[:, 0], x[:, 2])
    # Together the two parts are the whole data set, each digit once.
    counts = torch.bincount(torch.cat([y, ty]), minlength=10)
    assert torch.equal(counts, torch.bincount(torch.tensor(load_digits().target), minlength=10))


def test_digits_native_size_is_the_scaled_original():
    from sklearn.datasets import load_digits

    x, _ = finetune.digits(size=8, seed=0).train
    originals = torch.tensor(load_digits().images, dtype=torch.float32) / 16.0
    # every training image is one of the originals, scaled to [0, 1]
    flat = originals.flatten(1)
    for image in x[:20, 0]:
        assert (flat - image.flatten()).abs().amax(dim=1).min() < 1e-6


def test_digits_deterministic_by_seed():
    a, b, c = finetune.digits(16, seed=3), finetune.digits(16, seed=3), finetune.digits(16, seed=4)
    assert torch.equal(a.train[0], b.train[0]) and torch.equal(a.test[1], b.test[1])
    assert not torch.equal(a.train[1], c.train[1])


# --- schemes --------------------------------------------------------------------------

ARCHS = ["cifar", "resnet18", "mobilenet_v2", "mobilenet_v3_small", "shufflenet_v2_x0_5"]
# arch -> (the head, a parameter of the last block, a bias-free batch-norm weight or None)
EXPECTED = {
    "cifar": ("classifier.3", "features.6.weight", None),
    "resnet18": ("fc", "layer4.1.bn2.weight", "layer1.0.bn1.weight"),
    "mobilenet_v2": ("classifier.1", "features.18.0.weight", "features.1.conv.0.1.weight"),
    "mobilenet_v3_small": ("classifier.3", "features.12.0.weight", "features.0.1.weight"),
    "shufflenet_v2_x0_5": ("fc", "conv5.0.weight", "stage2.0.branch1.1.weight"),
}


def build(arch: str) -> nn.Module:
    try:
        return finetune.architecture(arch, classes=10, seed=0)
    except TorchvisionUnavailable as err:
        pytest.skip(str(err))


@pytest.mark.parametrize("arch", ARCHS)
def test_schemes_select_parameters(arch):
    head, last_block, norm_weight = EXPECTED[arch]
    names = [n for n, _ in build(arch).named_parameters()]
    trained = {
        s: set(finetune.trainable_names(finetune.apply_scheme(build(arch), s)))
        for s in ("full", "bias-only", "last-layers")
    }
    assert trained["full"] == set(names)
    assert {f"{head}.weight", f"{head}.bias"} <= trained["bias-only"]
    assert all(n.endswith(".bias") or n.startswith(f"{head}.") for n in trained["bias-only"])
    assert {n for n in names if n.endswith(".bias")} <= trained["bias-only"]
    if norm_weight is not None:  # batch-norm biases train, their weights do not
        assert norm_weight not in trained["bias-only"]
        assert norm_weight.replace(".weight", ".bias") in trained["bias-only"]
    assert last_block in trained["last-layers"] and f"{head}.weight" in trained["last-layers"]
    assert "features.0.weight" not in trained["last-layers"]  # the stem stays frozen
    assert len(trained["last-layers"]) < len(names)


@pytest.mark.parametrize("arch", ARCHS)
def test_adapter_starts_as_the_backbone_and_trains_only_adapters_and_head(arch):
    net = build(arch).eval()
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = net(x)
    adapted = finetune.apply_scheme(net, "adapter").eval()
    adapters = [m for m in adapted.modules() if isinstance(m, finetune.ResidualAdapter)]
    assert len(adapters) == finetune.ADAPTED_BLOCKS
    with torch.no_grad():
        assert torch.equal(adapted(x), before)
    head = EXPECTED[arch][0]
    trained = finetune.trainable_names(adapted)
    assert len(trained) == 2 * finetune.ADAPTED_BLOCKS + 2
    assert all(".adapter." in n or n.startswith(f"{head}.") for n in trained)
    # The zero-initialised adapters get a gradient through the frozen backbone.
    nn.functional.cross_entropy(adapted(x), torch.tensor([1, 2])).backward()
    assert all(float(a.adapter.weight.grad.abs().sum()) > 0 for a in adapters)


def test_unknown_scheme_and_architecture():
    with pytest.raises(ValueError, match="one of full, last-layers, bias-only, adapter"):
        finetune.apply_scheme(small_net(), "everything")
    try:
        with pytest.raises(ValueError, match="unknown architecture 'resnet5'"):
            finetune.architecture("resnet5")
    except TorchvisionUnavailable as err:
        pytest.skip(str(err))


# --- fit ------------------------------------------------------------------------------


def assert_tracks_torch(result: finetune.FitResult, tolerance: float) -> None:
    for index, step in enumerate(result.steps):
        gap = abs(step.program_loss - step.torch_loss)
        assert gap <= tolerance * max(1.0, abs(step.torch_loss)), (index, step)
    # The program's running statistics moved as torch's (train-mode batch norm).
    for name in ("1.running_mean", "1.running_var", "4.running_var"):
        ours, theirs = result.program_state[name], result.torch_state[name]
        assert not torch.equal(theirs, small_net()[int(name[0])].get_buffer(name[2:]))
        assert torch.allclose(ours, theirs, rtol=tolerance, atol=tolerance), name
    assert int(result.program_state["1.num_batches_tracked"]) == len(result.steps)


def test_fit_cpu_only_program_tracks_torch(digits8):
    result = finetune.fit(
        small_net(),
        digits8.train,
        digits8.test,
        batch=8,
        steps=4,
        eval_every=2,
        lr=0.1,
        momentum=0.9,
        cpu_only=True,
    )
    assert result.delegates == 0 and result.cpu_only
    assert [e.step for e in result.evaluations] == [0, 2, 4]
    assert result.dropped_per_epoch == 1500 % 8
    assert_tracks_torch(result, 1e-4)
    final = result.evaluations[-1]
    assert abs(final.program_accuracy - final.torch_accuracy) <= 2 / 297


def test_fit_torch_copy_drops_what_the_program_drops(digits8):
    """With dropout: torch on the program's masks (the default) tracks the CPU-only
    program to float rounding; on its own masks it does not."""
    run = dict(batch=8, steps=3, lr=0.1, cpu_only=True)
    shared = finetune.fit(dropout_net(), digits8.train, digits8.test, **run)
    assert_tracks_torch(shared, 1e-4)
    own = finetune.fit(dropout_net(), digits8.train, digits8.test, torch_masks="own", **run)
    assert [s.program_loss for s in own.steps] == [s.program_loss for s in shared.steps]
    assert max(abs(s.program_loss - s.torch_loss) for s in own.steps) > 1e-3, own.steps
    with pytest.raises(ValueError, match="torch_masks"):
        finetune.fit(dropout_net(), digits8.train, digits8.test, torch_masks="mine", **run)


def test_fit_torch_copy_starts_from_torch_start(digits8):
    """``torch_start``: the torch copy takes the given weights, the program keeps
    ``model``'s."""
    other = small_net(seed=1)
    result = finetune.fit(
        small_net(),
        digits8.train,
        digits8.test,
        batch=8,
        steps=1,
        lr=0.1,
        cpu_only=True,
        torch_start=other.state_dict(),
    )
    x, y = next(finetune._batches(digits8.train, 8, 0))
    with torch.no_grad():
        theirs = float(nn.functional.cross_entropy(other.train()(x), y))
        ours = float(nn.functional.cross_entropy(small_net().train()(x), y))
    assert abs(ours - theirs) > 1e-3, (ours, theirs)  # the two starts differ
    assert result.steps[0].torch_loss == theirs, result.steps
    assert abs(result.steps[0].program_loss - ours) <= 1e-4, result.steps


@pytest.mark.htp
def test_fit_on_the_simulator_tracks_torch(digits8, qnn_sdk):
    result = finetune.fit(
        small_net(), digits8.train, digits8.test, batch=8, steps=4, eval_every=2, lr=0.1
    )
    assert result.delegates >= 1 and not result.cpu_only
    assert [e.step for e in result.evaluations] == [0, 2, 4]
    assert result.dropped_per_epoch == 1500 % 8
    assert_tracks_torch(result, 3e-2)
    assert result.mean_step_seconds > 0


def test_fit_drops_odd_sized_loader_batches(digits8):
    x, y = digits8.train
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x[:20], y[:20]), batch_size=8
    )  # 8, 8 and a last batch of 4
    result = finetune.fit(small_net(), loader, digits8.test, batch=8, epochs=2, cpu_only=True)
    assert len(result.steps) == 4 and [e.step for e in result.evaluations] == [0, 2, 4]


def test_cli_end_to_end_writes_png(tmp_path, monkeypatch, capsys):
    """The command on 8x8 digits with the small net standing in for ``--arch``'s model
    (the CIFAR example needs 32x32 and minutes on CPU)."""
    monkeypatch.setattr(finetune, "architecture", lambda arch, classes=10, seed=0: small_net())
    png = tmp_path / "curves.png"
    argv = ["finetune", "--cpu", "--size", "8", "--batch", "8", "--steps", "2", "--png", str(png)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "loss program" in out and "held-out accuracy after 2 steps" in out
    assert "0 delegate(s)" in out and f"curves: {png}" in out


# --- slow tier ------------------------------------------------------------------------


@pytest.mark.htp
@pytest.mark.slow(reason="150 simulator steps of the CIFAR-10 example (about 20 minutes)")
def test_cifar_example_learns_digits_in_train_mode_like_torch(qnn_sdk):
    data = finetune.digits(size=32, seed=0)
    result = finetune.fit(
        finetune.architecture("cifar", seed=0),
        data.train,
        data.test,
        batch=16,
        steps=150,
        eval_every=50,
        lr=0.02,
        momentum=0.9,
    )
    assert result.train_mode and result.delegates >= 1
    final = result.evaluations[-1]
    assert final.program_accuracy >= 0.70, result.evaluations
    assert abs(final.program_accuracy - final.torch_accuracy) <= 0.03, result.evaluations


# --- the optimizer inside the program ---------------------------------------------------


@pytest.fixture(scope="module")
def adamw_runs(digits8):
    """Four AdamW steps straight (with the torch copy, a cosine schedule, checkpoints
    every two steps), and the same run resumed from its checkpoint after step 2."""
    run = dict(
        batch=8,
        steps=4,
        lr=0.01,
        weight_decay=0.05,
        optimizer="adamw",
        lr_schedule="cosine",
        cpu_only=True,
        checkpoint_every=2,
    )
    checkpoints: list[dict] = []
    straight = finetune.fit(
        small_net(), digits8.train, digits8.test, on_checkpoint=checkpoints.append, **run
    )
    (checkpoint,) = checkpoints
    resumed = finetune.fit(small_net(), digits8.train, digits8.test, resume=checkpoint, **run)
    return straight, checkpoint, resumed


def test_fit_with_adamw_in_the_program_tracks_torch_adamw(adamw_runs):
    """``optimizer="adamw"``: the program applies AdamW itself, the torch copy steps with
    ``torch.optim.AdamW`` of the same settings, both at the scheduled rates."""
    straight, _, _ = adamw_runs
    assert straight.optimizer == {
        "name": "adamw",
        "lr": 0.01,
        "betas": [0.9, 0.999],
        "eps": 1e-8,
        "weight_decay": 0.05,
    }
    assert straight.program.optimizer.optimizer == training.AdamW(0.01, weight_decay=0.05)
    for index, step in enumerate(straight.steps):
        assert abs(step.program_loss - step.torch_loss) <= 1e-4, (index, step)
    # The convolution biases in front of batch norms get a gradient that is zero up to
    # rounding, which Adam turns into a step of +-lr by its sign; they, and the running
    # means they shift, are left out.
    skip = {"0.bias", "3.bias", "1.running_mean", "4.running_mean"}
    for name, theirs in straight.torch_state.items():
        if name not in skip and theirs.dtype.is_floating_point:
            torch.testing.assert_close(
                straight.program_state[name], theirs, rtol=1e-4, atol=1e-4, msg=name
            )


def test_fit_resumes_adamw_from_its_checkpoint_to_the_bit(adamw_runs):
    """The checkpoint holds every tensor the program keeps (AdamW's moments, its step
    count, the learning rate, the running statistics): the resumed run's remaining
    losses and final tensors equal the uninterrupted run's bit for bit."""
    from qnn_convbwd.passes import optimizer as optimizer_pass

    straight, checkpoint, resumed = adamw_runs
    state = checkpoint["program_state"]
    assert float(state[optimizer_pass.STEP_BUFFER]) == 2.0
    assert float(state[optimizer_pass.LR_BUFFER]) == 0.01 * finetune.lr_factor("cosine", 1, 4)
    moments = [n for n in state if n.endswith("_exp_avg_sq")]
    assert moments and all(float(state[n].abs().sum()) > 0 for n in moments)
    groups = checkpoint["program_optimizer"]["param_groups"]
    assert groups[0]["betas"] == (0.9, 0.999) and groups[0]["weight_decay"] == 0.05
    assert [s.program_loss for s in resumed.steps] == [s.program_loss for s in straight.steps]
    assert [s.torch_loss for s in resumed.steps] == [s.torch_loss for s in straight.steps]
    assert set(resumed.program_final) == set(straight.program_final)
    for name, value in straight.program_final.items():
        assert torch.equal(resumed.program_final[name], value), name
    # A checkpoint of another optimizer is refused.
    with pytest.raises(ValueError, match="optimizer"):
        finetune.fit(small_net(), (torch.zeros(8, 3, 8, 8), torch.zeros(8, dtype=torch.int64)),
                     None, batch=8, steps=4, optimizer="sgd", resume=checkpoint)  # fmt: skip


def test_program_optimizer_choices():
    assert finetune.program_optimizer("sgd", 0.1, 0.9, None) == training.SGD(0.1, momentum=0.9)
    assert finetune.program_optimizer("adamw", 0.1) == training.AdamW(0.1, weight_decay=0.01)
    with pytest.raises(ValueError, match="momentum 0.9 is SGD's"):
        finetune.program_optimizer("adamw", 0.1, 0.9)
    with pytest.raises(ValueError, match="one of sgd, adamw"):
        finetune.program_optimizer("adam", 0.1)
