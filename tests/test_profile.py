"""``qnn_convbwd_dev.profile`` and ``qnn-convbwd profile``: a training step's CPU ops,
delegate calls, optimizer and delegate bytes, read from a small program's ETDump.

The CPU-only program (SM8350) runs in the quick tier; the bytes of a delegate and
the simulator's delegate calls need the toolchain (``htp``). The numbers a profile
reports are checked against the ``.pte`` itself: its ``forward`` plan's kernel and
delegate instructions and the tensors each delegate call is given.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from torch import nn

import qnn_convbwd
from qnn_convbwd import cli, finetune, training
from qnn_convbwd_dev import profile

BATCH, SIZE = 4, 8


def small_net(seed: int = 0) -> nn.Module:
    """Two ConvBn blocks (train mode), average pool, dropout 0.5 and a linear head."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Dropout(0.5),
        nn.Linear(16, 10),
    ).train()


def lowered(soc: str) -> tuple[training.TrainingProgram, tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, 3, SIZE, SIZE, generator=generator)
    y = torch.randint(0, 10, (BATCH,), generator=generator)
    module = training.WithLoss(small_net(), nn.CrossEntropyLoss())
    with qnn_convbwd.enabled(dropout_seed=0):
        program = training.lower_for_training(module, (x, y), qnn_convbwd.compile_specs(soc))
    return program, (x, y)


def forward_plan(pte: bytes):
    from executorch.exir._serialize._program import deserialize_pte_binary

    result = deserialize_pte_binary(pte)
    program = getattr(result, "program", result)
    return next(p for p in program.execution_plan if p.name == "forward")


def kernel_calls(pte: bytes) -> Counter:
    """How often each operator (``aten::permute_copy`` -> ``permute_copy``) is called by
    one run of ``forward``: its kernel-call instructions (the plan has no jumps)."""
    from executorch.exir.schema import JumpFalseCall, KernelCall

    plan = forward_plan(pte)
    found: Counter = Counter()
    for chain in plan.chains:
        for instruction in chain.instructions:
            call = instruction.instr_args
            assert not isinstance(call, JumpFalseCall), "a plan with control flow"
            if isinstance(call, KernelCall):
                found[plan.operators[call.op_index].name.split("::")[-1]] += 1
    return found


SCALAR_BYTES = {"FLOAT": 4, "HALF": 2, "INT": 4, "LONG": 8, "BOOL": 1, "BYTE": 1}


def delegate_call_bytes(pte: bytes) -> list[list[int]]:
    """Each delegate call's argument tensors' bytes (inputs, then outputs), from the plan."""
    from executorch.exir.schema import DelegateCall

    plan = forward_plan(pte)
    calls = []
    for chain in plan.chains:
        for instruction in chain.instructions:
            call = instruction.instr_args
            if isinstance(call, DelegateCall):
                sizes = []
                for index in call.args:
                    tensor = plan.values[index].val
                    numel = 1
                    for d in tensor.sizes:
                        numel *= d
                    sizes.append(numel * SCALAR_BYTES[tensor.scalar_type.name])
                calls.append(sizes)
    return calls


@pytest.fixture(scope="module")
def on_cpu():
    program, inputs = lowered(profile.CPU_SOC)
    result = profile.profile_program(
        program, inputs, label="CPU only", soc=profile.CPU_SOC, steps=2, warmup=1
    )
    return program, inputs, result


def by_operator(result: profile.ProgramProfile) -> Counter:
    found: Counter = Counter()
    for op in result.timings.cpu_ops:
        found[op.op.split(".")[0]] += op.calls
    return found


def test_cpu_ops_are_the_programs_kernel_calls(on_cpu):
    program, _, result = on_cpu
    assert by_operator(result) == kernel_calls(program.pte)
    # The whole step on CPU: convolutions and their backward among the ops, no delegate.
    assert {"convolution", "convolution_backward"} <= set(by_operator(result))
    assert result.timings.delegate_calls == 0 and result.delegates == []
    assert result.bytes_in == result.bytes_out == 0


def test_times_are_per_profiled_step(on_cpu):
    _, _, result = on_cpu
    t = result.timings
    assert len(t.per_step_execute_ms) == 2 and len(result.per_step_optimizer_ms) == 2
    assert len(result.losses) == 3  # the warm-up step's loss too
    for op in t.cpu_ops:
        assert len(op.per_step_ms) == 2 and op.ms == pytest.approx(sum(op.per_step_ms) / 2)
    # The ops run inside Method::execute, step by step.
    for k in range(2):
        assert sum(op.per_step_ms[k] for op in t.cpu_ops) <= t.per_step_execute_ms[k]
    assert t.cpu_ms == pytest.approx(sum(op.ms for op in t.cpu_ops))
    assert result.optimizer_ms > 0
    assert result.step_ms == pytest.approx(t.execute_ms + result.optimizer_ms)


def test_the_optimizer_steps_as_a_session_does(on_cpu):
    """A profiled run trains as ``TrainingSession.step`` does: the same losses."""
    program, inputs, result = on_cpu
    session = program.session(0.01)
    losses = [session.step(list(inputs)) for _ in range(3)]
    session.close()
    assert losses == result.losses
    assert losses[0] != losses[2]  # the parameters moved


def test_session_without_etdump_or_gradients_says_so(on_cpu):
    program, _, _ = on_cpu
    session = program.session(0.01)
    with pytest.raises(RuntimeError, match="no gradients before the first forward_backward"):
        session.optimizer_step()
    with pytest.raises(RuntimeError, match="etdump=True"):
        session.write_etdump("a.etdp", "a.bin")
    session.close()


def test_json_round_trips(on_cpu, tmp_path):
    _, _, result = on_cpu
    stored = profile.Profile("small", "full", BATCH, SIZE, 2, result, result)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(stored.to_json()))
    loaded = profile.Profile.from_json(json.loads(path.read_text()))
    assert loaded == stored
    # The CPU-only program against itself: its host part is its whole step but the
    # runtime's own time outside the instructions, which varies with the host's load.
    share = loaded.host_share
    assert share == pytest.approx(
        (result.timings.cpu_ms + result.optimizer_ms)
        / (result.timings.execute_ms + result.optimizer_ms)
    )
    assert 0.0 < share <= 1.0
    table = profile.to_markdown(loaded)
    assert "| convolution_backward |" in table and f"**{share:.3f}**" in table


def test_read_etdump_refuses_a_wrong_run_count(on_cpu, tmp_path):
    program, inputs, _ = on_cpu
    session = program.session(0.01, etdump=True)
    session.forward_backward(list(inputs))
    session.forward_backward(list(inputs))
    etdump = tmp_path / "run.etdp"
    session.write_etdump(str(etdump), str(tmp_path / "debug.bin"))
    session.close()
    assert profile.read_etdump(etdump, runs=2, skip=1).delegate_calls == 0
    with pytest.raises(profile.ProfileError, match="no block of events with 3 executions"):
        profile.read_etdump(etdump, runs=3)
    with pytest.raises(ValueError, match="at least one of the 2 runs"):
        profile.read_etdump(etdump, runs=2, skip=2)


@pytest.mark.slow(
    reason="the command lowers its own program (~25 s idle); what it prints is tested above"
)
def test_cli_prints_the_profile_and_writes_json(on_cpu, tmp_path, monkeypatch, capsys):
    """``qnn-convbwd profile`` on the small net standing in for ``--model``'s, lowered for
    SM8350 (no simulator) and without the baseline (one lowering)."""
    monkeypatch.setattr(finetune, "architecture", lambda arch, classes=10, seed=0: small_net())
    path = tmp_path / "p.json"
    argv = ["profile", "--model", "small", "--soc", profile.CPU_SOC, "--batch", str(BATCH)]
    argv += ["--size", str(SIZE), "--steps", "1", "--no-cpu-baseline", "--json", str(path)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "| | CPU only (SM8350) calls | ms |\n" in out and "Host share" not in out
    stored = profile.Profile.from_json(json.loads(path.read_text()))
    assert stored.model == "small" and stored.steps == 1 and stored.cpu is None
    # The command lowered the program the fixture lowered (same net, batch and seed).
    assert by_operator(stored.npu) == kernel_calls(on_cpu[0].pte)
    assert cli.main(["profile", "--from-json", str(path)]) == 0
    assert profile.to_markdown(stored) in capsys.readouterr().out


# --- a delegate: bytes and the simulator's calls -----------------------------------------


@pytest.fixture(scope="module")
def on_htp(qnn_sdk):
    program, inputs = lowered("SM8650")
    result = profile.profile_program(program, inputs, label="NPU", soc="SM8650", steps=1)
    return program, result


def test_delegate_bytes_are_the_tensors_each_call_is_given(on_htp):
    program, result = on_htp
    calls = delegate_call_bytes(program.pte)
    assert len(calls) == len(result.delegates) >= 1
    for call, delegate in zip(calls, result.delegates):
        assert len(call) == len(delegate.inputs) + len(delegate.outputs)
        assert sum(call[: len(delegate.inputs)]) == delegate.bytes_in
        assert sum(call[len(delegate.inputs) :]) == delegate.bytes_out


def test_delegate_roles_name_the_trained_weights_both_ways(on_htp):
    """Every conv weight enters in the HWIO layout as a parameter and its gradient leaves
    in it; the batch norms' statistics go to the running-statistic updates on CPU."""
    program, result = on_htp
    tensors = [t for d in result.delegates for t in d.inputs]
    out = [t for d in result.delegates for t in d.outputs]
    net = small_net()
    for conv in (net[0], net[3]):
        hwio = tuple(conv.weight.permute(2, 3, 1, 0).shape)
        assert any(t.role == "parameter" and t.shape == hwio for t in tensors), hwio
        assert any(t.role == "gradient" and t.shape == hwio for t in out), hwio
    trained = sum(p.numel() for p in net.parameters())
    assert sum(t.nbytes for t in out if t.role == "gradient") == 4 * trained
    assert [t.shape for t in out if t.role == "loss"] == [()]
    assert any(t.role == "cpu" for t in out)  # batch statistics for the running ones


def test_simulator_delegate_calls_and_cpu_ops_are_the_plans(on_htp):
    program, result = on_htp
    assert result.timings.delegate_calls == len(delegate_call_bytes(program.pte))
    assert result.timings.delegate_ms > 0
    assert by_operator(result) == kernel_calls(program.pte)
    # The program stores the trained convolutions' weights in HWIO: nothing is permuted
    # on CPU (weight_storage="filter"; tests/test_filter_storage.py compares the two).
    assert "permute_copy" not in by_operator(result)
