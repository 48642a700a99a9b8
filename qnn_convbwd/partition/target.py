"""What the compile specs target (backend, SoC and HTP architecture), and the target
rules every op family shares.

An unknown target (``Target.unknown``) is what the plugin's transform pass sees when
executorch builds it without compile specs (its recipe and test flows call
``get_to_edge_transform_passes(program)``); the partitioner always knows the target.
One policy for it, in ``backend_is_htp``: a verdict the partitioner takes again with
the real target waits for it; a verdict the transform pass settles for good keeps the
node on CPU. convolution_backward is the first kind: the pass prepares a delegated
node for the HTP (split gradients, shape-only operands, 1-D lifted to 2-D), which
computes the same values on CPU, and the partitioner re-runs the rules. A max pool
backward is the second: the pass either gives it int32 indices (which executorch's
CPU kernel cannot read) or rewrites it for CPU, and no later step undoes either; on
CPU it is right whatever the target is.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .. import integration
from .verdict import Rejection

# The oldest HTP the plugin's lowerings compile for (QAIRT 2.51): V68 cannot create
# the TransposeConv2d of grad_input, nor the float ElementWiseSelect of a max pool
# backward's window masks ("could not create op: q::Select.exe", docs/max_pool.md).
MIN_HTP_ARCH = 69
FLOAT_DTYPES = (torch.float32, torch.float16)

_BACKENDS = {"kHtpBackend": "htp", "kGpuBackend": "gpu", "kLpaiBackend": "lpai"}


@dataclasses.dataclass(frozen=True)
class Target:
    backend: str | None  # "htp", "gpu", "lpai", another name, or None when unknown
    soc: str  # QcomChipset name, e.g. "SM8650"
    htp_arch: int | None  # 68, 69, 73, ... ; None when the SoC has no HTP
    saver: bool
    edge_program: Any = dataclasses.field(default=None, compare=False, repr=False)

    @classmethod
    def from_compile_specs(cls, compile_specs: list, edge_program: Any = None) -> Target:
        option = integration.get("generate_qnn_executorch_option")(compile_specs)
        options = integration.get("flatbuffer_to_option")(option)
        backend_type = options.backend_options.backend_type
        backend = _BACKENDS.get(getattr(backend_type, "name", str(backend_type)), str(backend_type))
        soc = getattr(options.soc_info.soc_model, "name", str(options.soc_info.soc_model))
        arch = integration.get("get_soc_to_htp_arch_map")().get(soc)
        return cls(
            backend=backend,
            soc=soc,
            htp_arch=int(arch) if arch is not None else None,
            saver=bool(options.saver),
            edge_program=edge_program,
        )

    @classmethod
    def unknown(cls, edge_program: Any = None) -> Target:
        """No compile specs at hand: target rules are deferred to the partitioner."""
        return cls(
            backend=None, soc="unknown", htp_arch=None, saver=False, edge_program=edge_program
        )

    @property
    def known(self) -> bool:
        return self.backend is not None

    def with_program(self, edge_program: Any) -> Target:
        return dataclasses.replace(self, edge_program=edge_program)


def backend_is_htp(target: Target, settled_before_partitioning: bool) -> Rejection | None:
    """The target rule ``backend_is_htp`` of every family. ``settled_before_partitioning``:
    the transform pass acts on the verdict in a way no later step undoes, so an unknown
    target keeps the node on CPU (the module's policy); otherwise it waits for the
    partitioner."""
    if not target.known:
        if settled_before_partitioning:
            return Rejection("compile specs unknown: kept on CPU", "no compile specs")
        return None
    if target.backend != "htp":
        return Rejection("backend is not HTP", f"backend={target.backend}")
    return None


def below_min_arch(target: Target) -> bool:
    """A known target whose HTP is older than ``MIN_HTP_ARCH`` (or that has no HTP)."""
    return target.known and (target.htp_arch is None or target.htp_arch < MIN_HTP_ARCH)


def htp_arch_supported(target: Target, what: str) -> Rejection | None:
    """The target rule ``htp_arch_supported`` of the op families; ``what``: the part of
    the op's lowering an older HTP cannot compile."""
    if not below_min_arch(target):
        return None
    return Rejection(
        f"HTP arch below V{MIN_HTP_ARCH} cannot compile {what}",
        f"soc={target.soc}, arch=V{target.htp_arch}",
    )
