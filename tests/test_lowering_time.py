"""``qnn_convbwd_dev.lowering_time``: phases of a real lowering timed, executorch left as it was."""

import importlib

import pytest
import torch

from qnn_convbwd_dev import lowering_time


class _Conv(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x))


def test_timed_needs_the_plugin_enabled():
    with pytest.raises(RuntimeError, match="inside qnn_convbwd.enabled"):
        with lowering_time.timed():
            pass


@pytest.mark.htp
def test_a_lowering_is_timed_per_delegate_and_the_wrappers_removed(qnn_sdk):
    from qnn_convbwd.toolchain import harness

    backend = importlib.import_module("executorch.backends.qualcomm.qnn_preprocess").QnnBackend
    before = {name: backend.__dict__[name] for name in ("preprocess", "_build_op_wrappers")}
    program = torch.export.export(_Conv().eval(), (torch.randn(1, 4, 6, 6),), strict=True)
    timing, result = lowering_time.measure(program, harness.compile_specs("SM8650"))
    assert len(timing.delegates) == 1
    (delegate,) = timing.delegates
    assert delegate.qnn_ops["Conv2d"] == 1 and delegate.qnn_ops["Relu"] == 1
    assert delegate.finalise_s > 0 and delegate.build_s > 0
    assert timing.backend_s >= delegate.build_s + delegate.finalise_s
    assert timing.total_s >= timing.export_passes_s + timing.partition_s + timing.backend_s
    assert lowering_time.aten_ops(program)["conv2d.default"] == 1
    assert {name: backend.__dict__[name] for name in before} == before
