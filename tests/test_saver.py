"""The Saver recorder and parser, on recordings made here by the real QNN Saver backend.

A small forward conv model pins the parser to facts known from torch (op types,
parameter values, weight bytes in params.bin order). A joint training graph
lowered with qnn_convbwd shows the input gradient's TransposeConv2d reading the
very STATIC weight tensor the forward Conv2d reads, through a Transpose, with
the weight's bytes stored once in the graph.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from qnn_convbwd.toolchain import saver, sdk

pytestmark = pytest.mark.htp


class SmallConv(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x))


@pytest.fixture(scope="module")
def small_conv(qnn_sdk, tmp_path_factory):
    torch.manual_seed(0)
    model = SmallConv().eval()
    program = torch.export.export(model, (torch.randn(1, 3, 9, 9),))
    keep = tmp_path_factory.mktemp("saver_small_conv")
    return model, saver.record(program, "SM8650", keep=keep), keep


def _param_name(program: torch.export.ExportedProgram, tensor: str) -> str:
    """Parameter target (``backbone.2.weight``) of a QNN tensor (``p_backbone_2_weight@0``)."""
    placeholder = tensor.split("@")[0]
    for spec in program.graph_signature.input_specs:
        if spec.arg.name == placeholder:
            return spec.target
    raise KeyError(tensor)


def test_small_conv_ops_and_tensor_types(small_conv):
    _, graph, _ = small_conv
    types = [op.type for op in graph.ops]
    assert types.count("Conv2d") == 1 and types.count("Relu") == 1, types
    conv = graph.ops_of_type("Conv2d")[0]
    relu = graph.ops_of_type("Relu")[0]
    assert relu.inputs == conv.outputs  # the graph is connected by tensor names
    assert graph.tensors[conv.outputs[0]].type == "NATIVE"
    # Graph input and output: written and read by the application.
    kinds = {t.type for t in graph.tensors.values() if graph.producer(t.name) is None}
    assert "APP_WRITE" in kinds
    outputs = [
        t for t in graph.tensors.values() if t.type != "STATIC" and not graph.consumers(t.name)
    ]
    assert [t.type for t in outputs] == ["APP_READ"]
    assert outputs[0].dims == (1, 4, 5, 5)  # NCHW again after the closing Transpose


def test_small_conv_parameters(small_conv):
    _, graph, _ = small_conv
    conv = graph.ops_of_type("Conv2d")[0]
    assert conv.package == "qti.aisw"
    assert conv.params["stride"] == [2, 2]
    assert conv.params["pad_amount"] == [[1, 1], [1, 1]]
    assert conv.params["dilation"] == [1, 1]
    assert conv.params["group"] == 1
    # Parameter tensors are static but are not op inputs: static_bytes leaves them out.
    assert conv.param_tensors and not set(conv.param_tensors) & set(conv.inputs)


def test_small_conv_static_weight_bytes(small_conv):
    model, graph, _ = small_conv
    conv = graph.ops_of_type("Conv2d")[0]
    weight, bias = (graph.tensors[name] for name in conv.inputs[1:])
    assert (weight.type, bias.type) == ("STATIC", "STATIC")
    assert weight.dtype_name == "FLOAT_32"
    assert len(weight.data) == model.conv.weight.numel() * 4
    assert graph.static_bytes == (model.conv.weight.numel() + model.conv.bias.numel()) * 4
    # The bytes are the weight itself, in QNN's HWIO filter layout (torch's OIHW
    # permuted by (2, 3, 1, 0)): proves params.bin is consumed in the right order.
    hwio = model.conv.weight.detach().permute(2, 3, 1, 0).numpy()
    np.testing.assert_array_equal(graph.tensor_array(weight.name), hwio)
    np.testing.assert_array_equal(graph.tensor_array(bias.name), model.conv.bias.detach().numpy())


def test_parser_rejects_params_that_do_not_match(small_conv):
    _, _, keep = small_conv
    source = (keep / saver.SAVER_C).read_text()
    params = (keep / saver.SAVER_PARAMS).read_bytes()
    assert saver.parse(source, params).ops  # the recording itself parses
    with pytest.raises(saver.SaverFormatError, match="passes the end"):
        saver.parse(source, params[:-4])
    with pytest.raises(saver.SaverFormatError, match="reads .* bytes of params.bin"):
        saver.parse(source, params + b"\0\0\0\0")


def test_validated_ops_are_not_graph_ops(small_conv):
    _, graph, keep = small_conv
    source = (keep / saver.SAVER_C).read_text()
    # executorch passes each op to backendValidateOpConfig before graphCreate, so
    # the file declares the Conv2d config twice; the graph has it once.
    declared = [line for line in source.splitlines() if "Qnn_OpConfigV1_t" in line]
    assert sum('"qti.aisw", "Conv2d"' in line for line in declared) == 2
    assert len(graph.ops_of_type("Conv2d")) == 1
    assert source.count("interface.graphAddNode(") == len(graph.ops)


def test_type_codes_match_executorch_enums():
    adaptor = pytest.importorskip("executorch.backends.qualcomm.python.PyQnnManagerAdaptor")
    tensor_types = {
        int(v): k.removeprefix("QNN_TENSOR_TYPE_")
        for k, v in adaptor.Qnn_TensorType_t.__members__.items()
        if k != "QNN_TENSOR_TYPE_UNDEFINED"
    }
    assert tensor_types == saver.TENSOR_TYPES
    data_types = {
        int(v): k.removeprefix("QNN_DATATYPE_")
        for k, v in adaptor.Qnn_DataType_t.__members__.items()
        if k != "QNN_DATATYPE_UNDEFINED"
    }
    assert data_types == {code: name for code, (name, _) in saver.DATA_TYPES.items()}


def _part_of(graph: saver.SaverGraph, tensor: str, values: np.ndarray) -> bool:
    """True when every element of the static ``tensor`` is one of ``values`` (any layout)."""
    data = graph.tensor_array(tensor).ravel()
    if data.dtype != values.dtype:
        return False
    return not Counter(data.tolist()) - Counter(values.tolist())


def test_joint_graph_transpose_conv_reads_the_forward_weight(qnn_sdk):
    # record() lowers in a child process that enables qnn_convbwd there (default options).
    from qnn_convbwd_dev.models import training_graph

    joint = training_graph("demo")
    graph = saver.record(joint.program, "SM8650")
    params = dict(joint.model.named_parameters())
    transpose_convs = graph.ops_of_type("TransposeConv2d")
    # One per convolution_backward that computes an input gradient (output_mask[0]):
    # the demo's four frozen backbone convs, all supported on SM8650.
    input_grads = [
        n
        for n in joint.program.graph.nodes
        if n.target is torch.ops.aten.convolution_backward.default and n.args[-1][0]
    ]
    assert len(input_grads) == 4
    # The stride-2 3x3 conv's grad_input is four phase TransposeConv2d
    # (Options.stride="phases"), each of the others one.
    phases = [op for op in transpose_convs if "_phase" in op.name]
    assert len(phases) == 4 and len({op.name.split("_phase")[0] for op in phases}) == 1
    assert len(transpose_convs) == len(input_grads) + 3, [op.type for op in graph.ops]
    static = [t.name for t in graph.tensors.values() if t.type == "STATIC" and t.data]
    forward_convs = [op for op in graph.ops if op.type in ("Conv2d", "DepthWiseConv2d")]
    for tconv in transpose_convs:
        filter_producer = graph.producer(tconv.inputs[1])
        if tconv in phases:  # a phase's filter: a StridedSlice of the HWOI filter
            assert filter_producer is not None and filter_producer.type == "StridedSlice"
            filter_producer = graph.producer(filter_producer.inputs[0])
        assert filter_producer is not None and filter_producer.type == "Transpose", tconv
        # The STATIC tensor the filter's data comes from: the Transpose's input, or
        # the root of runtime ops (Multiply by one, Reshape, ...) above it.
        weight, chain = graph.first_input_chain(tconv.inputs[1])
        assert graph.tensors[weight].type == "STATIC", [op.type for op in chain]
        # The forward conv's weight comes from the same tensor (same name).
        readers = [op for op in forward_convs if graph.first_input_chain(op.inputs[1])[0] == weight]
        assert len(readers) == 1, [op.name for op in readers]
        # The static tensors made of this weight's values (whatever their layout)
        # hold each of them once: runtime_weight's head and its run-time tail.
        values = params[_param_name(joint.program, weight)].detach().numpy().ravel()
        parts = [name for name in static if _part_of(graph, name, values)]
        assert weight in parts and len(parts) == 2, parts
        held = Counter(v for name in parts for v in graph.tensor_array(name).ravel().tolist())
        assert held == Counter(values.tolist())


TWO_SAVER_LOWERINGS = """
import os, sys
import torch
import qnn_convbwd
from qnn_convbwd.toolchain import harness, saver

qnn_convbwd.enable()
program = torch.export.export(torch.nn.Conv2d(2, 4, 3), (torch.randn(1, 2, 6, 6),))
for attempt in ("first", "second"):
    os.makedirs(attempt)
    os.chdir(attempt)  # executorch writes ./saver_output
    try:
        qnn_convbwd.lower(program, harness.compile_specs("SM8650", saver=True))
    except SystemExit as stop:  # executorch's exit() after the Saver recorded the partition
        assert saver.SAVER_EXIT_MESSAGE in str(stop.code), stop.code
    graph = saver.load(saver.SAVER_DIR)
    print(attempt, [op.type for op in graph.ops])
    os.chdir("..")
"""


def test_two_saver_lowerings_in_one_process(qnn_sdk):
    # The Saver accepts one initialization per load of its library; the process keeps
    # the Saver loader shim loaded, which loads the real Saver afresh for each session.
    proc = sdk.probe_in_subprocess(TWO_SAVER_LOWERINGS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["first", "second"], proc.stdout
    assert all("'Conv2d'" in line for line in lines), proc.stdout
