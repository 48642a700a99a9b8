"""Torch's CPU kernels for references and calibrations, pinned against the process's history.

executorch 1.5.1's Qualcomm backend turns oneDNN (``torch.backends.mkldnn``) off
for the whole process on an AMD host whenever a lowering starts
(``backends/qualcomm/utils/qnn_sdk_setup.py``: ``disable_mkldnn_on_amd``, called
from ``QnnManagerRegistry.get_or_create_qnn_manager`` and the lowering entry
points of ``utils/utils.py``), and never turns it back on. Torch's fp32
convolutions then run its native kernels instead of oneDNN's: the same numbers
to ~4e-6 relative, but not to the bit. A model calibrated after a lowering gets
other batch-norm running statistics (mobilenet_v3_small: 10987 elements, 994 of
them in fp16), so the graph, its fp32 step and torch's fp16 step (the judge's
floor, a draw of fp16's rounding noise) depended on whether a lowering had run
earlier in the same process (docs/zoo.md).

``pinned()`` sets oneDNN to ``ONEDNN`` and torch to one thread for the block,
and restores the caller's settings after it. The judge's fp32 reference
(``models.autograd_reference``) and the calibrations of the test models run
inside it, so their numbers are those of a fresh process, whatever ran before,
on any host. One thread, because the thread count is part of the numbers: with
two, a MobileNet-like bias-only fp32 step differed from run to run in the last
bits of 44 of 104 outputs over 8 reruns (none on one thread), and a
mobilenet_v3_small calibration at 32 px, though the same on every run, had 64
of its 244 state tensors other than on one thread, so a zoo graph built by a
script depended on the host's core count (the tests, one thread per xdist
worker, saw the one-thread graph).

Torch's float16 step (``fidelity.fp16_reference``, the judge's floor) runs with
oneDNN off (``fp16_kernels()``, ``pinned(FP16_ONEDNN)``): on a host whose
processor has native fp16 instructions (AVX512-FP16, AMX-FP16) torch hands
float16 matrix products to oneDNN's fp16 kernels, which round otherwise than
torch's own (fp32 accumulation, one rounding per op), so the floor depended on
the host: the small-loss graph's ``adapter.bias`` floor was 5.5e-4 on such a
host and 7.3e-4 on one without (or with ``ONEDNN_MAX_CPU_ISA=AVX2``, or oneDNN
off). Torch's own kernels give the second on every x86-64 host; on one thread,
as everything pinned (with two, the same step on the same host differed from
run to run in the last bit of some gradients).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

# torch's default: what every reference and calibration saw before a lowering ran.
ONEDNN = True
# The float16 step: torch's own kernels, the same numbers on every x86-64 host.
FP16_ONEDNN = False


@contextlib.contextmanager
def pinned(onednn: bool | None = None) -> Iterator[None]:
    """oneDNN set to ``onednn`` (default ``ONEDNN``) and torch on one thread inside the
    block; the caller's thread count and oneDNN flags are restored after it."""
    # None leaves deterministic / allow_tf32 / fp32_precision as they are; on exit
    # torch's bracket restores all four.
    enabled = ONEDNN if onednn is None else onednn
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.backends.mkldnn.flags(
            enabled=enabled, deterministic=None, allow_tf32=None, fp32_precision=None
        ):
            yield
    finally:
        torch.set_num_threads(threads)


def fp16_kernels() -> contextlib.AbstractContextManager[None]:
    """Torch's own float16 kernels on one thread inside the block (``FP16_ONEDNN``): the
    judge's fp16 step, the same on every host and every run."""
    return pinned(FP16_ONEDNN)
