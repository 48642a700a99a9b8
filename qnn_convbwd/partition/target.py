"""What the compile specs target: backend, SoC and HTP architecture."""

from __future__ import annotations

import dataclasses
from typing import Any

from .. import integration

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
