"""A quantized backbone's head fine-tuned on a shifted domain on the simulator, beside
torch on the same converted backbone (``qnn_convbwd_dev.quantized_domain_shift``,
docs/quantized.md): a short version of ``scripts/quantized_domain_shift.py``."""

from __future__ import annotations

import pytest

from qnn_convbwd_dev import quantized_domain_shift as ds


@pytest.mark.htp
@pytest.mark.slow(reason="pretraining on CPU, a lowering and 30 simulator steps: minutes")
def test_the_head_learns_inverted_digits_as_torch_does(qnn_sdk):
    found = ds.run("invert", steps=30, pretrain_epochs=2)
    # One delegate; on CPU only the in-program optimizer's update and its state.
    assert found.delegates == 1, found
    assert set(found.on_cpu) <= {"optimizer_on_cpu", "program_state_on_cpu"}, found.on_cpu
    # The backbone recognises the digits it was trained on, quantized too, and not
    # the inverted ones.
    assert found.quantized_accuracy >= 0.8 and found.shifted_before <= 0.5, found
    # 30 steps of the head move the shifted accuracy up, on the HTP as in torch.
    assert found.program_accuracy >= found.shifted_before + 0.2, found
    assert found.gap_points <= 3.0, found
    # The first steps, from the same head, follow torch's losses; later the two heads
    # have taken their own (fp16 and fp32) steps and the losses agree less closely.
    for step, (ours, theirs) in enumerate(found.losses[:3]):
        assert abs(ours - theirs) <= 3e-2 * max(1.0, abs(theirs)), (step, ours, theirs)


def test_pretraining_is_the_same_after_the_backend_switches_mkldnn_off():
    """``pretrain`` runs on the MKLDNN backend a fresh process has, also where a
    lowering or a quantizer has turned it off for the process (as executorch's Qualcomm
    backend does on an AMD host): the same seed trains the same weights."""
    import torch

    from qnn_convbwd import finetune

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no MKLDNN backend: there is nothing to switch off")
    split = finetune.digits(32, 0)
    fresh = ds.pretrain(split, epochs=1, samples=64)
    with torch.backends.mkldnn.flags(enabled=False):
        switched_off = ds.pretrain(split, epochs=1, samples=64)
        assert not torch.backends.mkldnn.enabled  # the caller's setting is kept
    for (name, a), (_, b) in zip(fresh.state_dict().items(), switched_off.state_dict().items()):
        assert torch.equal(a, b), name
