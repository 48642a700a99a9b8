"""3-D convolution_backward on HTP.

grad_input is a TransposeConv3d, grad_weight a Conv3d with batch and channels
exchanged, grad_bias a ReduceSum, all on NDHWC activations. Four defects of the
QNN 3-D ops (QAIRT 2.51 simulator) shape the lowering (``geometry/conv.py``):
TransposeConv3d ignores ``group`` (the filter is made block-diagonal and the op
runs ungrouped), crops D by H's ``pad_amount`` (the "crop" plan: the op runs
unpadded and a StridedSlice cuts grad_input out), is wrong when its H and W
strides differ (the spatial dims are reordered around it), and Conv3d rejects
dilation (grad_weight's filter gets zeros inserted instead). Three different
strides keep a grad_input node on CPU (``tests/cases.py``:
``conv3d_three_strides``, run by ``test_gates.py``).

Tolerances as in ``test_full_backward.py``: 4u times each output's sum of |terms|.
"""

from __future__ import annotations

import copy

import pytest
import torch
from programs import ALL_MASKS, Config, ConvBackwardBank, assert_bank_matches, generate_3d_configs
from tiers import sweep

import qnn_convbwd
from qnn_convbwd import integration
from qnn_convbwd.builders import input_gradient_runtime_weight as rw
from qnn_convbwd_dev import models

CONFIGS = [
    *generate_3d_configs(12, seed=3),
    # Dilation in every dim (a dilated TransposeConv3d filter; Conv3d stride 2).
    Config(1, 4, 4, (3, 3, 3), (1, 1, 1), (2, 2, 2), 1, (6, 7, 6), (2, 2, 2), ALL_MASKS[0]),
    # H != W strides (TransposeConv3d runs with the spatial dims reordered), grouped.
    Config(2, 4, 6, (3, 2, 3), (1, 1, 2), (1, 0, 1), 2, (5, 6, 7), mask=ALL_MASKS[0]),
    # Output padding beyond the padding (grad_output gets a zero row appended).
    Config(1, 4, 6, (3, 3, 3), (2, 2, 2), (0, 0, 0), 1, (6, 6, 6)),
]


def _op_types(graphs) -> list[str]:
    return [op.op_type for graph in graphs for op in graph]


def _assert_structure(graphs, configs: list[Config]) -> None:
    """The QNN graph holds exactly the 3-D ops the configs ask for, wired as planned."""
    types = _op_types(graphs)
    assert "TransposeConv2d" not in types and "Conv2d" not in types, sorted(set(types))
    assert types.count("TransposeConv3d") == sum(c.mask[0] for c in configs)
    assert types.count("Conv3d") == sum(c.mask[1] for c in configs)
    assert types.count("ReduceSum") == sum(c.mask[2] for c in configs)
    # H != W strides: grad_output transposed to the reordered dims and grad_input back.
    reordered = sum(c.mask[0] and c.stride[1] != c.stride[2] for c in configs)
    for suffix in ("_reorder", "_restore"):
        moved = [op for g in graphs for op in g if op.name.endswith(suffix)]
        assert len(moved) == reordered and {op.op_type for op in moved} <= {"Transpose"}
    ops = [op for graph in graphs for op in graph]
    readers = {}
    for op in ops:
        for tensor in op.inputs:
            readers.setdefault(tensor.name, []).append(op)
    for op in ops:
        if op.op_type == "TransposeConv3d":
            source, weight = op.inputs
            (result,) = op.outputs
            assert len(source.dims) == len(weight.dims) == len(result.dims) == 5
            # Ungrouped: the filter reaches every output channel (block-diagonal when grouped).
            assert weight.dims[-1] == result.dims[-1], (op.name, weight.dims, result.dims)
            # The "crop" plan: the op's output is sliced, never handed out directly.
            assert [r.op_type for r in readers[result.name]] == ["StridedSlice"], op.name
        if op.op_type == "Conv3d":
            # grad_weight: grad_output is the filter, a runtime tensor.
            assert not op.inputs[1].is_static, op.name


@pytest.mark.htp
@pytest.mark.parametrize("soc", sweep(["SM8850"], ["SM8550"]))  # V81; V73 with --slow
def test_conv3d_backward_matches_aten(qnn_sdk, soc):
    from qnn_convbwd.toolchain import harness

    bank = ConvBackwardBank(CONFIGS)
    with integration.capture_qnn_graphs() as graphs:
        compiled = harness.lower_program(bank.export(), soc)
    assert compiled.report.delegated == len(CONFIGS), [r.reason for r in compiled.report.rows]
    assert harness.delegate_count(compiled.edge) == 1
    _assert_structure(graphs, CONFIGS)
    assert_bank_matches(compiled, bank)


class Video3d(torch.nn.Module):
    """A small video-style stack: trainable 1x1x1 adapter, a 3-D backbone with a
    (2, 1, 2)-strided conv (grad_input reorders its spatial dims) and a grouped conv."""

    def __init__(self, trainable_backbone: bool = False) -> None:
        super().__init__()
        self.adapter = torch.nn.Conv3d(4, 4, 1)
        self.backbone = torch.nn.Sequential(
            torch.nn.Conv3d(4, 8, 3, stride=(2, 1, 2), padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv3d(8, 8, 3, padding=1, groups=2),
        )
        self.backbone.requires_grad_(trainable_backbone)

    def forward(self, x, target):
        return torch.nn.functional.mse_loss(self.backbone(self.adapter(x)), target)


@pytest.mark.htp
def test_conv3d_training_graph_runs_every_convolution_on_htp(qnn_sdk):
    """Joint graph with a frozen backbone: every convolution and convolution_backward in
    one delegate; the groups=1 weight read by a grad_input is stored once
    (runtime_weight), the grouped one keeps its static filter and a block-diagonal copy."""
    from torch.export.experimental import _export_forward_backward

    from qnn_convbwd.toolchain import harness

    torch.manual_seed(0)
    model = Video3d()
    x = torch.randn(1, 4, 4, 7, 7)
    with torch.no_grad():
        target = torch.randn_like(model.backbone(model.adapter(x)))
    joint = _export_forward_backward(torch.export.export(model, (x, target), strict=True))
    with integration.capture_qnn_graphs() as graphs:
        compiled = harness.lower_program(joint, "SM8650")
    rows = compiled.report.rows
    assert len(rows) == 3 and all(r.delegated for r in rows), [r.reason for r in rows]
    top = [n for n in compiled.edge.exported_program().graph.nodes if n.op == "call_function"]
    assert not [n for n in top if "convolution" in str(n.target)], "a convolution stayed on CPU"
    assert harness.delegate_count(compiled.edge) == 1

    ops = [op for graph in graphs for op in graph]

    def tensors(name: str) -> set:
        # QNN tensor names carry the wrapper index: "p_backbone_0_weight@0".
        return {t for op in ops for t in op.inputs if t.name.split("@")[0] == name}

    # backbone.0 (groups 1): stored once, flat, as a head that Concat copies and a
    # tail that the Multiply by 1.0 reads; the forward Conv3d and the backward's
    # Transpose read the runtime DHWIO tensor. Its strides (2, 1, 2) run
    # TransposeConv3d with D and H exchanged: (1, 2, 2).
    head, tail = rw.stored_layout(model.backbone[0].weight.numel())
    (stored,) = {t for t in tensors("p_backbone_0_weight") if t.is_static}
    (stored_tail,) = tensors("p_backbone_0_weight_runtime_tail")
    assert (stored.dims, stored_tail.dims) == ((1, head), (1, tail)) and stored_tail.is_static
    hwoi = "p_backbone_0_weight_convbwd_hwoi_order102"
    filters = {op.inputs[1] for op in ops if op.op_type in ("Conv3d", "TransposeConv3d")}
    assert {t.name for t in filters} >= {"p_backbone_0_weight", hwoi}
    assert not any(t.is_static for t in tensors(hwoi))
    # backbone.2 (groups 2): static DHWIO for the forward, a block-diagonal static
    # DHWOI for the ungrouped TransposeConv3d.
    assert {t.dims for t in tensors("p_backbone_2_weight") if t.is_static} == {(3, 3, 3, 4, 8)}
    (dense,) = tensors("p_backbone_2_weight_convbwd_hwoi_dense_2")
    assert dense.is_static and dense.dims == (3, 3, 3, 8, 8)

    # Tolerance as in test_full_backward.py, twice the error torch makes in fp32 when
    # the inputs and weights are rounded to fp16, but with a floor of 1% of each
    # output rather than 0.1%: the adapter's bias gradient sums 196 positions whose
    # |terms| add up to ~10x the result, and the HTP's fp16 sum errs by ~1.2 u of
    # that (measured 4.4e-5 of 8.3e-3).
    expected = models.autograd_reference(model, (x, target), joint)
    rounded = copy.deepcopy(model)
    rounded.load_state_dict({k: v.half().float() for k, v in model.state_dict().items()})
    noisy = models.autograd_reference(rounded, (x.half().float(), target.half().float()), joint)
    outputs = compiled.run((x, target))[: len(expected)]
    for got, want, near in zip(outputs, expected, noisy, strict=True):
        tol = 2 * (near - want).abs().max().item() + 1e-2 * want.abs().max().item()
        assert (got - want).abs().max().item() <= tol


def test_conv3d_trainable_grouped_grad_input_stays_on_cpu_with_its_reason():
    """A trainable grouped 3-D weight is read at run time; its grad_input would need a
    block-diagonal filter built from the weight's values (TransposeConv3d ignores
    groups), so that node stays on CPU and the report says why."""
    from torch.export.experimental import _export_forward_backward

    from qnn_convbwd.toolchain import harness

    torch.manual_seed(0)
    model = Video3d(trainable_backbone=True)
    x = torch.randn(1, 4, 4, 7, 7)
    with torch.no_grad():
        target = torch.randn_like(model.backbone(model.adapter(x)))
    joint = _export_forward_backward(torch.export.export(model, (x, target), strict=True))
    report = qnn_convbwd.decide(joint, harness.compile_specs("SM8650"))
    kept = [r for r in report.rows if not r.delegated]
    assert len(kept) == 1 and kept[0].groups == 2, report.to_markdown()
    assert "block-diagonal" in kept[0].reason and "trainable" in kept[0].reason
