"""Compile programs for a SoC and run them on the x86-64 HTP simulator.

Used by the tests, the CLI and the benchmarks. Every function makes the SDK
usable first (``ensure_sdk``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import torch

from .. import logs, progress
from .sdk import ensure_sdk

# SoCs the tests and benchmarks use, with their HTP architecture.
SOC_ARCH = {
    "SM8350": 68,
    "SM8450": 69,
    "SM8550": 73,
    "SM8650": 75,
    "SM8750": 79,
    "SM8850": 81,
}


def compile_specs(soc: str = "SM8650", *, fp16: bool = True, saver: bool = False) -> list:
    """executorch compile specs for the HTP backend of ``soc`` (Saver records instead)."""
    ensure_sdk()
    from executorch.backends.qualcomm.serialization.qc_schema import QcomChipset
    from executorch.backends.qualcomm.utils.utils import (
        generate_htp_compiler_spec,
        generate_qnn_executorch_compiler_spec,
    )

    try:
        chipset = getattr(QcomChipset, soc)
    except AttributeError:
        known = [c.name for c in QcomChipset]
        raise ValueError(f"unknown SoC {soc!r}; executorch knows {known}") from None
    logs.quiet_libraries()  # executorch's partitioner set its logger to DEBUG on import
    return generate_qnn_executorch_compiler_spec(
        chipset, generate_htp_compiler_spec(use_fp16=fp16), saver=saver
    )


@dataclasses.dataclass
class Compiled:
    edge: Any  # EdgeProgramManager after lowering
    pte: bytes
    lower_seconds: float
    report: Any = None  # qnn_convbwd.Report when lowered through qnn_convbwd.lower

    @property
    def context_binaries(self) -> list[bytes]:
        return context_binaries(self.edge)

    @property
    def context_binary_bytes(self) -> int:
        return sum(len(b) for b in self.context_binaries)

    def run(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return run_pte(self.pte, inputs)


def context_binaries(edge: Any) -> list[bytes]:
    """The QNN context binaries of every delegate in the lowered program."""
    from .. import integration

    graph_module = edge.exported_program().graph_module
    submodules = integration.get("get_lowered_submodules")(graph_module)
    return [bytes(module.processed_bytes) for _, module, _ in submodules]


def delegate_count(edge: Any) -> int:
    from .. import integration

    return len(integration.get("get_lowered_submodules")(edge.exported_program().graph_module))


@progress.long_call("lowering")
def lower_module(
    module: torch.nn.Module, inputs: tuple, soc: str = "SM8650", *, fp16: bool = True
) -> Compiled:
    """Lower an nn.Module with executorch's own ``to_edge_transform_and_lower_to_qnn``."""
    specs = compile_specs(soc, fp16=fp16)
    from executorch.backends.qualcomm.utils.utils import to_edge_transform_and_lower_to_qnn

    start = time.perf_counter()
    edge = to_edge_transform_and_lower_to_qnn(module, inputs, specs)
    seconds = time.perf_counter() - start
    return Compiled(edge, edge.to_executorch().buffer, seconds)


@progress.long_call("lowering")
def lower_program(
    program: torch.export.ExportedProgram,
    soc: str = "SM8650",
    *,
    fp16: bool = True,
    skip_node_id_set: set | None = None,
    skip_node_op_set: set | None = None,
) -> Compiled:
    """Lower an ExportedProgram (e.g. a joint graph) through ``qnn_convbwd.lower``."""
    from .. import api

    specs = compile_specs(soc, fp16=fp16)
    start = time.perf_counter()
    result = api.lower(
        program, specs, skip_node_id_set=skip_node_id_set, skip_node_op_set=skip_node_op_set
    )
    seconds = time.perf_counter() - start
    return Compiled(result.edge, result.edge.to_executorch().buffer, seconds, result.report)


@progress.long_call("running on the HTP simulator")
def run_pte(pte: bytes, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Execute a program with executorch's runtime (QNN delegates on the HTP simulator)."""
    ensure_sdk()
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(pte)
    outputs = program.load_method("forward").execute(list(inputs))
    return [o.clone() if isinstance(o, torch.Tensor) else o for o in outputs]
