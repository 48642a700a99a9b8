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
    native = adaptor_enum("Qnn_TensorType_t").QNN_TENSOR_TYPE_NATIVE
    return declared_tensor(visitor, name, shape, dtype, nodes_to_wrappers, native)


def declared_tensor(
    visitor, name: str, shape: Sequence[int], dtype: torch.dtype, nodes_to_wrappers, tensor_type
):
    """A data-less QNN tensor of ``tensor_type`` (cached under ``name``)."""
    return visitor.define_custom_tensor_wrapper(
        node_name=name,
        tensor_type=tensor_type,
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


def constant_pad(name: str, source, result, amounts: Sequence[Sequence[int]], value: float):
    """Pad op with ``value``; ``amounts`` holds ``[before, after]`` for every axis."""
    names = integration.get("OpPad")
    pad = new_op(name, names.op_name, [source], [result])
    uint32_scalar(pad, names.param_scheme, names.Scheme.CONSTANT)
    float_scalar(pad, names.param_pad_constant_value, value)
    uint32_param(pad, names.param_pad_amount, [list(a) for a in amounts])
    return pad


def _zero_pad(name: str, source, result, amounts: Sequence[Sequence[int]]):
    """Pad op with zeros; ``amounts`` holds ``[before, after]`` for every axis."""
    return constant_pad(name, source, result, amounts, 0.0)


def zero_pad(name: str, source, result, amounts: Sequence[Sequence[int]]):
    """Pad op with zeros; ``amounts`` holds ``[before, after]`` for every axis."""
    return _zero_pad(name, source, result, amounts)


def zero_pad_end(name: str, source, result, trailing: Sequence[int]):
    """Pad op appending ``trailing[i]`` zeros after spatial dim i of an NHWC tensor."""
    return _zero_pad(name, source, result, [[0, 0], *([0, t] for t in trailing), [0, 0]])


def zero_insert(
    visitor,
    name: str,
    source,
    shape: Sequence[int],
    factors: Sequence[int],
    dtype: torch.dtype,
    nodes_to_wrappers,
    result=None,
):
    """Upsample spatial dim i of an N<spatial>C tensor by ``factors[i]`` with zeros.

    Element j of a dim moves to ``j * f``, followed by ``f - 1`` zeros. Per dim,
    with nothing stored: Pad the *next* axis to ``f`` times its size with zeros
    at the end, then Reshape so that the dim takes the factor. In row-major
    order a block of the next axis holds the data and the ``f - 1`` blocks after
    it are zeros, which the Reshape turns into ``f`` consecutive positions of
    the dim: data first, then zeros. The last Reshape writes into ``result``
    when given. Returns ``(ops, result, result_shape)``.

    Measured with QAIRT 2.51: doing all dims with one Pad (a view with a unit
    axis after each spatial dim, the last factor merged into the channels)
    stores no fewer bytes, and the simulator computes the depthwise stride-2
    TransposeConv2d after it wrongly (errors ~1e5).
    """
    ops = []
    shape = [int(v) for v in shape]
    last = max(dim for dim, factor in enumerate(factors) if factor > 1)
    for dim, factor in enumerate(factors):
        if factor == 1:
            continue
        axis = 1 + dim  # spatial dims start at 1; the next axis always exists
        amounts = [[0, 0] for _ in shape]
        amounts[axis + 1][1] = (factor - 1) * shape[axis + 1]
        padded_shape = [v + a for v, (_, a) in zip(shape, amounts, strict=True)]
        padded = native_tensor(visitor, f"{name}{dim}_pad", padded_shape, dtype, nodes_to_wrappers)
        ops.append(_zero_pad(f"{name}{dim}_pad_op", source, padded, amounts))
        shape[axis] *= factor
        if dim == last and result is not None:
            source = result
        else:
            source = native_tensor(visitor, f"{name}{dim}", shape, dtype, nodes_to_wrappers)
        ops.append(reshape(f"{name}{dim}_reshape", padded, source))
    return ops, source, shape


def reshape(name: str, source, result):
    """Reshape op: ``source``'s elements in ``result``'s dims, row-major order kept."""
    return new_op(name, integration.get("OpReshape").op_name, [source], [result])


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
