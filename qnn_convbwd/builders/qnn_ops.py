"""Small helpers that build QNN op wrappers and native tensors for the visitors."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .. import integration


def adaptor_enum(name: str):
    return integration.get(name)


def uint32_param(op, name: str, values) -> None:
    """Attach a uint32 tensor parameter (any nesting of lists) to ``op``."""
    array = np.asarray(values, dtype=np.uint32)
    shape = list(array.shape)
    op.AddTensorParam(
        name,
        adaptor_enum("Qnn_DataType_t").QNN_DATATYPE_UINT_32,
        len(shape),
        shape,
        array,
        True,
    )


def uint32_scalar(op, name: str, value: int) -> None:
    op.AddScalarParam(
        name,
        adaptor_enum("Qnn_DataType_t").QNN_DATATYPE_UINT_32,
        {integration.get("QCOM_DATA"): np.uint32(value)},
    )


def float_scalar(op, name: str, value: float) -> None:
    op.AddScalarParam(
        name,
        adaptor_enum("Qnn_DataType_t").QNN_DATATYPE_FLOAT_32,
        {integration.get("QCOM_DATA"): float(value)},
    )


def new_op(name: str, op_type: str, inputs: Sequence, outputs: Sequence):
    op = integration.get("PyQnnOpWrapper")(
        name, integration.get("QNN_OP_PACKAGE_NAME_QTI_AISW"), op_type
    )
    op.AddInputTensors(list(inputs))
    op.AddOutputTensors(list(outputs))
    return op


def native_tensor(visitor, name: str, shape: Sequence[int], dtype: torch.dtype, nodes_to_wrappers):
    """A data-less QNN tensor produced inside the graph (cached under ``name``)."""
    return visitor.define_custom_tensor_wrapper(
        node_name=name,
        tensor_type=adaptor_enum("Qnn_TensorType_t").QNN_TENSOR_TYPE_NATIVE,
        dtype=integration.get("QNN_TENSOR_TYPE_MAP")[dtype],
        quant_encoding=adaptor_enum(
            "Qnn_QuantizationEncoding_t"
        ).QNN_QUANTIZATION_ENCODING_UNDEFINED,
        quant_configs={},
        dims=torch.Size(shape),
        tensor=None,
        is_fake_tensor=True,
        nodes_to_wrappers=nodes_to_wrappers,
    )


def zero_pad_end(name: str, source, result, trailing: Sequence[int]):
    """Pad op appending ``trailing[i]`` zeros after spatial dim i of an NHWC tensor."""
    names = integration.get("OpPad")
    pad = new_op(name, names.op_name, [source], [result])
    uint32_scalar(pad, names.param_scheme, names.Scheme.CONSTANT)
    float_scalar(pad, names.param_pad_constant_value, 0.0)
    uint32_param(pad, names.param_pad_amount, [[0, 0], *([0, t] for t in trailing), [0, 0]])
    return pad


def transpose(name: str, source, result, perm: Sequence[int]):
    """Transpose op: ``result`` dim i is ``source`` dim ``perm[i]``."""
    names = integration.get("OpTranspose")
    op = new_op(name, names.op_name, [source], [result])
    uint32_param(op, names.param_perm, perm)
    return op


def bool_scalar(op, name: str, value: bool) -> None:
    op.AddScalarParam(
        name,
        adaptor_enum("Qnn_DataType_t").QNN_DATATYPE_BOOL_8,
        {integration.get("QCOM_DATA"): bool(value)},
    )


def strided_slice(name: str, source, result, ranges: Sequence[Sequence[int]]):
    """StridedSlice with per-dim [begin, end, step] ``ranges``."""
    names = integration.get("OpStridedSlice")
    op = new_op(name, names.op_name, [source], [result])
    array = np.asarray(ranges, dtype=np.int32)
    op.AddTensorParam(
        names.param_ranges,
        adaptor_enum("Qnn_DataType_t").QNN_DATATYPE_INT_32,
        2,
        list(array.shape),
        array,
        True,
    )
    return op


def static_tensor(
    name: str, value: np.ndarray | None, dims: Sequence[int], dtype: torch.dtype, nodes_to_wrappers
):
    """A QNN static tensor named ``name`` holding ``value`` (cached under ``name``).

    Takes numpy data. While executorch's partitioner validates ops, parameters
    are fake tensors without data: ``value`` is then None and only the shape is
    declared, as executorch's own visitors do.
    """
    cached = nodes_to_wrappers.get(name, {}).get(0)
    if cached is not None:
        return cached
    dims = [int(d) for d in dims]
    data = np.array([]) if value is None else np.ascontiguousarray(value)
    wrapper = integration.get("TensorWrapper")(
        name,
        adaptor_enum("Qnn_TensorType_t").QNN_TENSOR_TYPE_STATIC,
        integration.get("QNN_TENSOR_TYPE_MAP")[dtype],
        adaptor_enum("Qnn_QuantizationEncoding_t").QNN_QUANTIZATION_ENCODING_UNDEFINED,
        {},
        len(dims),
        dims,
        [],
        data,
        value is not None,
    )
    nodes_to_wrappers[name][0] = wrapper
    return wrapper
