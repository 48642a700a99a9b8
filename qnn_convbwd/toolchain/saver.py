"""Record what executorch hands to QNN with the Saver backend, and read the recording.

The QNN Saver backend does not compile: it writes every QNN API call it receives
as a C program (``saver_output.c``) plus the static tensor data that program
reads back (``params.bin``). That makes it the ground truth for "which QNN ops,
tensors and parameters did the lowering produce", independent of executorch's
Python objects.

``record(program, soc)`` lowers ``program`` with ``qnn_convbwd.lower`` and the
Saver backend in a child process: executorch 1.5.1's ``qnn_preprocess`` calls
``exit()`` right after the first partition is compiled when Saver is selected
(and writes into ``./saver_output`` of the current directory), so only the first
delegated partition is recorded. The program crosses the process boundary with
``torch.export.save``/``load``; on a joint forward-backward graph that round trip
adds ``getitem`` nodes, without users, for the unused (``None``) outputs of
``convolution_backward``. The child removes exactly those and checks that its
node list then equals the parent's.

``parse(c_source, params)`` turns a recording into a ``SaverGraph``. The format,
as written by the QAIRT 2.51 Saver (derived from recordings, no header used):

* one C statement per line; static data is declared ``static <ctype> V[n];``
  and filled by ``fread(V, elemsize, count, fp)`` from ``params.bin``, strictly
  in file order;
* tensors: ``Qnn_TensorV2_t T_v2 = {id, "name", (Qnn_TensorType_t)N, format,
  (Qnn_DataType_t)M, quantizeParams, rank, T_dims, memType, T_clientBuf, ...}``
  with ``Qnn_ClientBuffer_t T_clientBuf = {(void*)V, nbytes}`` or ``{NULL, 0}``;
* ops: ``Qnn_OpConfigV1_t X_v1 = {"name", "package", "Type", nparams, X_params,
  ninputs, X_inputs, noutputs, X_outputs}`` whose arrays list ``Qnn_Param_t`` /
  ``Qnn_Tensor_t`` variables; a param is ``{(Qnn_ParamType_t)k, "name",
  .tensorParam = T}`` or ``.scalarParam = S`` with ``Qnn_Scalar_t S = {dtype,
  .uint32Value = 1}``;
* the calls that matter are ``tensorCreateGraphTensor`` (declares a graph
  tensor) and ``graphAddNode`` (adds an op). Ops passed to
  ``backendValidateOpConfig`` before ``graphCreate`` are only validated; they
  are not part of the graph and are not returned. Every op input or parameter
  re-declares its tensor (and its static data) locally, so ``params.bin`` holds
  a static tensor's bytes more than once; the graph tensor is the one of that
  name declared by ``tensorCreateGraphTensor``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import operator
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import progress

logger = logging.getLogger(__name__)

# What executorch 1.5.1 passes to exit() after the Saver recorded the first partition.
SAVER_EXIT_MESSAGE = "Record all QNN API calls from saver backend at:"
SAVER_DIR = "saver_output"
SAVER_C = "saver_output.c"
SAVER_PARAMS = "params.bin"

# Qnn_TensorType_t codes -> names. Observed in recordings (0: graph inputs named
# "input_*", 1: graph outputs named "output_*", 3: intermediates without data,
# 4: weights and op parameters with data) and equal to executorch's
# PyQnnManagerAdaptor.Qnn_TensorType_t enum, which tests/test_saver.py checks.
TENSOR_TYPES = {
    0: "APP_WRITE",
    1: "APP_READ",
    2: "APP_READWRITE",
    3: "NATIVE",
    4: "STATIC",
    5: "NULL",
}

# Qnn_DataType_t codes -> (name, numpy dtype of the stored bytes). The fp32 and
# uint32 codes (562, 306) are observed with ``static float`` / ``static uint32_t``
# data; the whole table is checked against PyQnnManagerAdaptor.Qnn_DataType_t.
DATA_TYPES: dict[int, tuple[str, str]] = {
    8: ("INT_8", "int8"),
    22: ("INT_16", "int16"),
    50: ("INT_32", "int32"),
    100: ("INT_64", "int64"),
    264: ("UINT_8", "uint8"),
    278: ("UINT_16", "uint16"),
    306: ("UINT_32", "uint32"),
    356: ("UINT_64", "uint64"),
    534: ("FLOAT_16", "float16"),
    562: ("FLOAT_32", "float32"),
    776: ("SFIXED_POINT_8", "int8"),
    790: ("SFIXED_POINT_16", "int16"),
    818: ("SFIXED_POINT_32", "int32"),
    1032: ("UFIXED_POINT_8", "uint8"),
    1046: ("UFIXED_POINT_16", "uint16"),
    1074: ("UFIXED_POINT_32", "uint32"),
    1288: ("BOOL_8", "bool"),
}

# C element types of ``static`` arrays, for data whose QNN dtype is unknown.
_C_TYPES = {
    "float": "float32",
    "double": "float64",
    "int8_t": "int8",
    "uint8_t": "uint8",
    "int16_t": "int16",
    "uint16_t": "uint16",
    "int32_t": "int32",
    "uint32_t": "uint32",
    "int64_t": "int64",
    "uint64_t": "uint64",
}


class SaverError(RuntimeError):
    """No Saver recording could be made; the message carries the child's stderr tail."""


class SaverFormatError(ValueError):
    """The Saver C file does not have the shape this parser knows."""


@dataclasses.dataclass(frozen=True)
class SaverTensor:
    name: str
    type: str  # TENSOR_TYPES value, or "UNKNOWN_<code>"
    dtype: int  # Qnn_DataType_t code
    dims: tuple[int, ...]
    data: bytes | None  # static data, None for tensors without a client buffer

    @property
    def dtype_name(self) -> str:
        return DATA_TYPES.get(self.dtype, (f"UNKNOWN_{self.dtype}", ""))[0]

    @property
    def numel(self) -> int:
        return int(np.prod(self.dims, dtype=np.int64)) if self.dims else 1


@dataclasses.dataclass(frozen=True)
class SaverOp:
    name: str
    type: str  # QNN op type, e.g. "TransposeConv2d"
    package: str
    inputs: list[str]  # tensor names
    outputs: list[str]
    params: dict[str, Any]  # tensor params as nested lists (shaped by dims), scalars as numbers
    param_tensors: list[str]  # names of the tensors behind tensor params


@dataclasses.dataclass
class SaverGraph:
    name: str  # QNN graph name given to graphCreate
    tensors: dict[str, SaverTensor]
    ops: list[SaverOp]
    seconds: float | None = None  # wall time of record(), None when parsed directly
    # Parameter name -> the weight stored in its place (its batch norm folded in:
    # what ``passes.conv_batch_norm.observe_folds`` saw in the child's lowering).
    folded_weights: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    def ops_of_type(self, op_type: str) -> list[SaverOp]:
        return [op for op in self.ops if op.type == op_type]

    def producer(self, tensor: str) -> SaverOp | None:
        """The op writing ``tensor``, None for graph inputs and static tensors."""
        return next((op for op in self.ops if tensor in op.outputs), None)

    def consumers(self, tensor: str) -> list[SaverOp]:
        return [op for op in self.ops if tensor in op.inputs]

    def first_input_chain(self, tensor: str) -> tuple[str, list[SaverOp]]:
        """Follow ``tensor``'s producer's first input upwards to a tensor no op writes.

        Returns that tensor's name and the ops passed, nearest first. For data moved
        by layout ops (Transpose, Reshape, StridedSlice, Multiply by one) the root
        is the tensor the data comes from.
        """
        chain: list[SaverOp] = []
        while (op := self.producer(tensor)) is not None and op.inputs:
            if op in chain:
                raise SaverFormatError(f"tensor {tensor!r} is produced in a cycle")
            chain.append(op)
            tensor = op.inputs[0]
        return tensor, chain

    def static_inputs(self) -> list[SaverTensor]:
        """STATIC tensors some op reads as an input (weights, biases), not op parameters."""
        names = {name for op in self.ops for name in op.inputs}
        return [t for name, t in self.tensors.items() if name in names and t.type == "STATIC"]

    @property
    def static_bytes(self) -> int:
        """Bytes of static data the graph carries as op inputs, each tensor counted once."""
        return sum(len(t.data or b"") for t in self.static_inputs())

    def tensor_array(self, name: str) -> np.ndarray:
        """The static data of ``name`` as an array of its dims and QNN dtype."""
        tensor = self.tensors[name]
        if tensor.data is None:
            raise ValueError(f"tensor {name!r} ({tensor.type}) carries no static data")
        return _as_array(tensor.data, tensor.dtype, tensor.dims, None)


# --- parser ---------------------------------------------------------------------------

_ASSIGN = re.compile(
    r"^\s*(?:static\s+)?(?:const\s+)?(\w+)(\s*\*)?\s+(\w+)(\[\d*\])?\s*=\s*(.*);\s*$"
)
_STATIC = re.compile(r"^\s*static\s+([\w ]+?)\s+(\w+)\[(\d+)\];\s*$")
_FREAD = re.compile(r"^\s*fread\((\w+),\s*(\d+),\s*(\d+),\s*fp\);\s*$")
_CALL = re.compile(r"interface\.(\w+)\((.*)\)\);\s*$")
_CAST = re.compile(r"^\(\w+\)\s*(-?\d+)$")
_DESIGNATED = re.compile(r"^\.(\w+)\s*=\s*(.+)$")


def _split_fields(init: str) -> list[str]:
    """Top-level comma-separated fields of a ``{...}`` initializer."""
    text = init.strip()
    if not (text.startswith("{") and text.endswith("}")):
        raise SaverFormatError(f"not a brace initializer: {init[:80]!r}")
    text = text[1:-1]
    fields, depth, quoted, start = [], 0, False, 0
    for i, ch in enumerate(text):
        if quoted:
            if ch == '"' and text[i - 1] != "\\":
                quoted = False
        elif ch == '"':
            quoted = True
        elif ch in "{(":
            depth += 1
        elif ch in "})":
            depth -= 1
        elif ch == "," and depth == 0:
            fields.append(text[start:i].strip())
            start = i + 1
    last = text[start:].strip()
    if last:
        fields.append(last)
    return fields


def _string(field: str) -> str:
    if not (field.startswith('"') and field.endswith('"')):
        raise SaverFormatError(f"expected a string literal, got {field!r}")
    return field[1:-1]


def _code(field: str) -> int:
    """``(Qnn_Something_t)N`` or ``N`` -> N."""
    match = _CAST.match(field)
    return int(match.group(1) if match else field)


def _number(text: str) -> int | float:
    text = text.strip()
    try:
        return int(text, 0)
    except ValueError:
        return float(text)


def _as_array(data: bytes, dtype: int, dims: tuple[int, ...], c_type: str | None) -> np.ndarray:
    np_type = DATA_TYPES.get(dtype, ("", ""))[1] or _C_TYPES.get(c_type or "", "")
    if not np_type:
        raise SaverFormatError(f"no numpy type for Qnn_DataType_t {dtype} / C type {c_type}")
    array = np.frombuffer(data, dtype=np_type)
    return array.reshape(dims) if dims else array.reshape(())


@dataclasses.dataclass
class _Tensor:
    name: str
    type_code: int
    dtype: int
    dims: tuple[int, ...]
    data_var: str | None


class _Reader:
    """Walks the C file once, in order, keeping a table of the variables it declares."""

    def __init__(self, params: bytes) -> None:
        self.params = params
        self.offset = 0
        self.static_types: dict[str, str] = {}  # data variable -> C element type
        self.data: dict[str, bytes] = {}  # data variable -> bytes read by fread
        self.dims: dict[str, tuple[int, ...]] = {}
        self.buffers: dict[str, str | None] = {}  # clientBuf variable -> data variable
        self.tensor_structs: dict[str, _Tensor] = {}  # *_v1 / *_v2 struct variables
        self.tensors: dict[str, _Tensor] = {}  # Qnn_Tensor_t variables
        self.arrays: dict[str, list[str]] = {}  # Qnn_Tensor_t[] / Qnn_Param_t[] variables
        self.scalars: dict[str, int | float] = {}
        self.params_: dict[str, tuple[str, str, str]] = {}  # var -> (name, kind, target var)
        self.op_structs: dict[str, list[str]] = {}
        self.ops: dict[str, list[str]] = {}
        self.graph_names: dict[str, str] = {}  # graph handle variable -> name
        self.graph_tensors: dict[str, _Tensor] = {}  # tensor name -> declaration
        self.graph_ops: list[tuple[str, list[str]]] = []  # (graph handle, op fields)

    def fread(self, var: str, size: int, count: int, line_no: int) -> None:
        end = self.offset + size * count
        if end > len(self.params):
            raise SaverFormatError(
                f"line {line_no}: fread of {size * count} bytes into {var} passes the end of "
                f"params.bin ({len(self.params)} bytes, at {self.offset})"
            )
        self.data[var] = self.params[self.offset : end]
        self.offset = end

    def assign(self, c_type: str, pointer: bool, var: str, array: bool, init: str) -> None:
        if c_type == "uint32_t" and array:
            self.dims[var] = tuple(int(v) for v in _split_fields(init))
        elif c_type == "Qnn_ClientBuffer_t":
            fields = _split_fields(init)
            target = re.sub(r"^\(void\s*\*\)", "", fields[0]).strip()
            self.buffers[var] = None if target == "NULL" else target
        elif c_type in ("Qnn_TensorV1_t", "Qnn_TensorV2_t"):
            fields = _split_fields(init)
            if len(fields) < 10:
                raise SaverFormatError(f"{var}: {len(fields)} tensor fields, expected >= 10")
            rank = int(fields[6])
            dims = self.dims.get(fields[7], ()) if fields[7] != "NULL" else ()
            if len(dims) != rank:
                raise SaverFormatError(f"{var}: rank {rank} but dims {dims}")
            self.tensor_structs[var] = _Tensor(
                _string(fields[1]), _code(fields[2]), _code(fields[4]), dims,
                self.buffers.get(fields[9]),
            )  # fmt: skip
        elif c_type == "Qnn_Tensor_t" and not array:
            match = _DESIGNATED.match(_split_fields(init)[1])
            if match is None or match.group(2) not in self.tensor_structs:
                raise SaverFormatError(f"{var}: unknown tensor struct in {init[:120]!r}")
            self.tensors[var] = self.tensor_structs[match.group(2)]
        elif c_type in ("Qnn_Tensor_t", "Qnn_Param_t") and (array or pointer):
            self.arrays[var] = [] if init.strip() == "NULL" else _split_fields(init)
        elif c_type == "Qnn_Scalar_t":
            match = _DESIGNATED.match(_split_fields(init)[1])
            if match is None:
                raise SaverFormatError(f"{var}: scalar without a value: {init!r}")
            self.scalars[var] = _number(match.group(2))
        elif c_type == "Qnn_Param_t":
            fields = _split_fields(init)
            match = _DESIGNATED.match(fields[2])
            if match is None:
                raise SaverFormatError(f"{var}: param without a value: {init!r}")
            self.params_[var] = (_string(fields[1]), match.group(1), match.group(2).strip())
        elif c_type == "Qnn_OpConfigV1_t":
            self.op_structs[var] = _split_fields(init)
        elif c_type == "Qnn_OpConfig_t":
            match = _DESIGNATED.match(_split_fields(init)[1])
            if match is None or match.group(2) not in self.op_structs:
                raise SaverFormatError(f"{var}: unknown op struct in {init[:120]!r}")
            self.ops[var] = self.op_structs[match.group(2)]

    def call(self, api: str, args: list[str], line_no: int) -> None:
        if api == "graphCreate":
            self.graph_names[args[3].lstrip("&")] = _string(args[1])
        elif api in ("tensorCreateGraphTensor", "tensorCreateContextTensor"):
            tensor = self.tensors.get(args[1].lstrip("&"))
            if tensor is None:
                raise SaverFormatError(f"line {line_no}: {api} of an undeclared tensor {args[1]}")
            if tensor.name in self.graph_tensors:
                raise SaverFormatError(f"line {line_no}: tensor {tensor.name!r} created twice")
            self.graph_tensors[tensor.name] = tensor
        elif api == "graphAddNode":
            if args[1] not in self.ops:
                raise SaverFormatError(f"line {line_no}: graphAddNode of undeclared op {args[1]}")
            self.graph_ops.append((args[0], self.ops[args[1]]))

    def tensor_bytes(self, tensor: _Tensor) -> bytes | None:
        if tensor.data_var is None:
            return None
        if tensor.data_var not in self.data:
            raise SaverFormatError(f"tensor {tensor.name!r}: no fread filled {tensor.data_var}")
        return self.data[tensor.data_var]

    def param_value(self, var: str) -> tuple[str, Any, str | None]:
        name, kind, target = self.params_[var]
        if kind == "scalarParam":
            return name, self.scalars[target], None
        tensor = self.tensors[target]
        data = self.tensor_bytes(tensor)
        value = (
            None
            if data is None
            else _as_array(data, tensor.dtype, tensor.dims, self.static_types.get(tensor.data_var))
        )
        return name, None if value is None else value.tolist(), tensor.name


def parse(c_source: str, params: bytes) -> SaverGraph:
    """Read a Saver recording (``saver_output.c`` text and ``params.bin`` bytes)."""
    reader = _Reader(params)
    for line_no, line in enumerate(c_source.splitlines(), start=1):
        if match := _FREAD.match(line):
            reader.fread(match.group(1), int(match.group(2)), int(match.group(3)), line_no)
        elif match := _STATIC.match(line):
            reader.static_types[match.group(2)] = match.group(1).strip()
        elif "VALIDATE(error, interface." in line and (match := _CALL.search(line)):
            reader.call(match.group(1), _split_fields("{" + match.group(2) + "}"), line_no)
        elif match := _ASSIGN.match(line):
            c_type, pointer, var, array, init = match.groups()
            reader.assign(c_type, bool(pointer), var, bool(array), init)
    if reader.offset != len(params):
        raise SaverFormatError(
            f"the C file reads {reader.offset} bytes of params.bin, which has {len(params)}"
        )
    graphs = sorted({reader.graph_names.get(handle, handle) for handle, _ in reader.graph_ops})
    if len(graphs) > 1:
        raise SaverFormatError(f"parse() reads one graph; this recording adds ops to {graphs}")

    tensors = {}
    for name, tensor in reader.graph_tensors.items():
        tensors[name] = SaverTensor(
            name=name,
            type=TENSOR_TYPES.get(tensor.type_code, f"UNKNOWN_{tensor.type_code}"),
            dtype=tensor.dtype,
            dims=tensor.dims,
            data=reader.tensor_bytes(tensor),
        )
    ops = []
    for _, fields in reader.graph_ops:
        name, package, op_type = (_string(f) for f in fields[:3])
        values, param_tensors = {}, []
        for var in reader.arrays.get(fields[4], []):
            param_name, value, tensor_name = reader.param_value(var)
            values[param_name] = value
            if tensor_name is not None:
                param_tensors.append(tensor_name)
        inputs = [reader.tensors[v].name for v in reader.arrays.get(fields[6], [])]
        outputs = [reader.tensors[v].name for v in reader.arrays.get(fields[8], [])]
        declared = (int(fields[3]), int(fields[5]), int(fields[7]))
        if (len(values), len(inputs), len(outputs)) != declared:
            raise SaverFormatError(f"op {name}: counts do not match its arrays: {fields}")
        ops.append(SaverOp(name, op_type, package, inputs, outputs, values, param_tensors))
    for op in ops:
        unknown = [t for t in op.inputs + op.outputs if t not in tensors]
        if unknown:
            raise SaverFormatError(f"op {op.name} uses tensors never created: {unknown}")
    return SaverGraph(name=graphs[0] if graphs else "", tensors=tensors, ops=ops)


def load(directory: str | os.PathLike) -> SaverGraph:
    """Parse ``saver_output.c`` and ``params.bin`` from ``directory``."""
    directory = Path(directory)
    return parse((directory / SAVER_C).read_text(), (directory / SAVER_PARAMS).read_bytes())


# --- recording in a child process -------------------------------------------------------

_PROGRAM_FILE = "program.pt2"
_NODES_FILE = "nodes.json"
_OPTIONS_FILE = "options.json"
_FOLDED_FILE = "folded_weights.pt"


def _node_list(graph: torch.fx.Graph) -> list[list[str]]:
    return [[n.name, n.op, str(n.target)] for n in graph.nodes]


@progress.long_call("recording with the Saver backend")
def record(
    program: torch.export.ExportedProgram,
    soc: str = "SM8650",
    *,
    timeout: float = 600,
    keep: str | os.PathLike | None = None,
    options: dict[str, Any] | None = None,
) -> SaverGraph:
    """Lower ``program`` with the Saver backend for ``soc`` in a child process and parse it.

    Only the first delegated partition is recorded (executorch exits after it).
    ``keep`` names a directory to copy ``saver_output.c`` and ``params.bin`` to;
    ``options`` are passed to ``qnn_convbwd.enable`` in the child.
    Raises ``SaverError`` with the child's stderr tail when no recording appears.
    """
    from .sdk import ensure_sdk

    ensure_sdk()  # fail here, with SdkUnavailable's reason, rather than in the child
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="qnn_convbwd_saver_") as tmp:
        work = Path(tmp)
        torch.export.save(program, work / _PROGRAM_FILE)
        (work / _NODES_FILE).write_text(json.dumps(_node_list(program.graph)))
        (work / _OPTIONS_FILE).write_text(json.dumps(options or {}))
        cmd = [sys.executable, "-m", "qnn_convbwd.toolchain.saver", str(work), soc]
        try:
            proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as err:
            raise SaverError(f"Saver recording for {soc} did not finish in {timeout} s") from err
        out = work / SAVER_DIR
        if proc.returncode != 0 or not (out / SAVER_C).is_file():
            tail = "\n".join(proc.stderr.strip().splitlines()[-25:])
            raise SaverError(
                f"no Saver recording for {soc} (child exit code {proc.returncode}); "
                f"stderr tail:\n{tail}"
            )
        if keep is not None:
            Path(keep).mkdir(parents=True, exist_ok=True)
            for name in (SAVER_C, SAVER_PARAMS):
                shutil.copy2(out / name, Path(keep) / name)
        graph = load(out)
        if (work / _FOLDED_FILE).is_file():
            graph.folded_weights = torch.load(work / _FOLDED_FILE)
    graph.seconds = time.perf_counter() - start
    logger.info(
        "Saver recording for %s: %d ops, %d tensors, %d static bytes, %.1f s",
        soc,
        len(graph.ops),
        len(graph.tensors),
        graph.static_bytes,
        graph.seconds,
    )
    return graph


def _load_program(work: Path) -> torch.export.ExportedProgram:
    """Load the parent's program; drop only the dead getitem nodes the round trip added."""
    program = torch.export.load(work / _PROGRAM_FILE)
    expected = json.loads((work / _NODES_FILE).read_text())
    original = {name for name, _, _ in expected}
    graph = program.graph
    for node in list(graph.nodes):
        if node.target is operator.getitem and not node.users and node.name not in original:
            graph.erase_node(node)
    program.graph_module.recompile()
    got = _node_list(graph)
    if got != expected:
        missing = [n for n in expected if n not in got][:5]
        extra = [n for n in got if n not in expected][:5]
        raise SaverError(
            f"torch.export save/load changed the graph: missing {missing}, added {extra}"
        )
    return program


def _child_main(work: Path, soc: str) -> int:
    from .sdk import ensure_sdk

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ensure_sdk()
    import qnn_convbwd

    from .harness import compile_specs

    program = _load_program(work)
    qnn_convbwd.enable(**json.loads((work / _OPTIONS_FILE).read_text()))
    from ..passes.conv_batch_norm import observe_folds

    os.chdir(work)  # executorch writes ./saver_output
    folded: dict[str, torch.Tensor] = {}  # a later fold of the same name replaces it
    try:
        with observe_folds(folded.__setitem__):
            qnn_convbwd.lower(program, compile_specs(soc, saver=True))
    except SystemExit as stop:
        if SAVER_EXIT_MESSAGE in str(stop.code):
            torch.save(folded, work / _FOLDED_FILE)
            return 0
        raise
    sys.stderr.write(
        "lowering finished without executorch's Saver exit: nothing was delegated to QNN\n"
    )
    return 3


if __name__ == "__main__":
    sys.exit(_child_main(Path(sys.argv[1]), sys.argv[2]))
