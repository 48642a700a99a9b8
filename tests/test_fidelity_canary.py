"""The fidelity canary (``qnn_convbwd_dev.canary``): zoo training steps on the simulator
against the record in the repository.

The simulator tests lower each canary with the options as they are, run one step
and compare it with the record: a digest other than the recorded one (the HTP
computes other bits) or a tensor whose relative L2 error grew by more than 10 %
fails. A change that means to alter the numbers records them anew
(``qnn-convbwd fidelity --canary --record``) with the table it prints. The record
check and ``compare``'s own cases run without the toolchain.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qnn_convbwd_dev import canary
from qnn_convbwd_dev.canary import Measurement, TensorErrors

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def _measurement(rel_l2: dict[str, float], digest: str = "a" * 64) -> Measurement:
    tensors = {
        name: TensorErrors(rel_l2=value, cosine=0.99, floor_rel_l2=value, floor_cosine=0.99,
                           within=True)
        for name, value in rel_l2.items()
    }  # fmt: skip
    return Measurement(digest, 2 * len(tensors), tensors)


def test_a_measurement_equal_to_its_record_matches():
    m = _measurement({"loss": 1e-3, "conv.bias": 2e-2})
    assert canary.compare(m, m) == []


def test_a_changed_digest_fails_even_with_smaller_errors():
    recorded = _measurement({"loss": 1e-3, "conv.bias": 2e-2})
    better = _measurement({"loss": 1e-3, "conv.bias": 1e-2}, digest="b" * 64)
    (problem,) = canary.compare(recorded, better)
    assert "digest" in problem


@pytest.mark.parametrize(("factor", "fails"), [(1.09, False), (1.11, True)])
def test_an_error_fails_past_ten_percent_growth(factor, fails):
    recorded = _measurement({"loss": 1e-3, "conv.bias": 2e-2})
    grown = _measurement({"loss": 1e-3, "conv.bias": 2e-2 * factor})
    problems = canary.compare(recorded, grown)
    assert bool(problems) == fails
    if fails:
        assert problems[0].startswith("conv.bias: relative L2")


def test_a_non_finite_error_and_a_missing_record_fail():
    recorded = _measurement({"loss": 1e-3})
    assert canary.compare(recorded, _measurement({"loss": float("inf")}))
    assert canary.compare(recorded, _measurement({"loss": float("nan")}))
    zero_in_fp32 = _measurement({"loss": float("inf")})  # recorded infinite: not a growth
    assert canary.compare(zero_in_fp32, zero_in_fp32) == []
    assert canary.compare(None, recorded)[0].startswith("no record")
    assert canary.compare(recorded, _measurement({"loss": 1e-3, "extra.bias": 0.1}))


def test_the_digest_sees_one_bit_dtype_and_shape():
    a = torch.linspace(-1, 1, 12)
    flipped = a.clone()
    flipped.view(torch.int32)[5] ^= 1
    assert canary.digest([a]) == canary.digest([a.clone()])
    assert canary.digest([a]) != canary.digest([flipped])
    assert canary.digest([a]) != canary.digest([a.reshape(3, 4)])
    assert canary.digest([a]) != canary.digest([a.double()])
    loss = torch.tensor(0.25)  # a 0-dim output
    assert canary.digest([loss]) != canary.digest([torch.tensor(0.5)])


def test_the_record_holds_every_canary_as_defined():
    """Each canary has a recorded measurement made with its current settings, and the
    record round-trips through its JSON form."""
    import json

    data = json.loads(canary.RECORD.read_text())
    assert sorted(data) == sorted(c.name for c in canary.CANARIES)
    for c in canary.CANARIES:
        assert data[c.name]["canary"] == c.about(), c.name
    for name, m in canary.load().items():
        assert Measurement.from_json(m.to_json()) == m
        assert len(m.digest) == 64 and m.tensors, name


def _check(c: canary.Canary, **options) -> list[str]:
    import qnn_convbwd

    with qnn_convbwd.enabled(**options):
        measured = canary.measure(c)
    return canary.compare(canary.load().get(c.name), measured)


CANARIES = [
    pytest.param(c, id=c.name)
    if c.quick
    else pytest.param(c, id=c.name, marks=pytest.mark.slow(reason="a zoo lowering of minutes"))
    for c in canary.CANARIES
]


@pytest.mark.parametrize("c", CANARIES)
def test_the_canary_matches_its_record(qnn_sdk, c):
    problems = _check(c)
    assert problems == [], "\n".join(problems)


@pytest.mark.slow(reason="one more lowering of the quick canary, with another option")
def test_a_changed_bias_formulation_fails_the_canary(qnn_sdk):
    quick = next(c for c in canary.CANARIES if c.quick)
    problems = _check(quick, mul_over_add="keep")
    assert any("digest" in p for p in problems), problems


def test_the_canaries_are_distinct():
    names = [c.name for c in canary.CANARIES]
    assert len(set(names)) == len(names)
    assert {c.mode for c in canary.CANARIES} == {"eval", "train"}
    assert any(c.quick for c in canary.CANARIES)
    assert all(dataclasses.asdict(c) == c.about() for c in canary.CANARIES)


def test_judged_outputs_of_a_train_mode_graph():
    """A train() graph's joint program lists its running-statistic updates first; the
    emitted program writes those back in place and appends the trained parameters:
    ``judged`` takes the loss and the gradients in either form."""
    from qnn_convbwd import training

    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).train()
    model = training.WithLoss(net, lambda y, t: torch.nn.functional.mse_loss(y.mean((2, 3)), t))
    joint = training.export_joint(model, (torch.randn(2, 3, 6, 6), torch.randn(2, 4)))
    kinds = [s.kind.name for s in joint.graph_signature.output_specs]
    assert kinds.count("BUFFER_MUTATION") == 3 and kinds.count("GRADIENT_TO_PARAMETER") == 4
    judged = [i for i, k in enumerate(kinds) if k in canary.JUDGED]
    every = [torch.tensor(float(i)) for i in range(len(kinds) + 4)]
    assert [int(t) for t in canary.judged(joint, every)] == judged
    returned = [torch.tensor(float(i)) for i in range(len(judged) + 4)]
    assert [int(t) for t in canary.judged(joint, returned)] == list(range(len(judged)))
    with pytest.raises(ValueError, match="program outputs"):
        canary.judged(joint, returned[:-1])
