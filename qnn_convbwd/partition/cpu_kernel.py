"""What executorch's CPU kernel of convolution_backward can execute.

A node the partitioner leaves on CPU runs on executorch's portable
``aten::convolution_backward.out`` (executorch 1.5.1:
``kernels/portable/cpu/op_convolution_backward.cpp``), which computes 2-D,
non-transposed convolutions only and fails the program at run time otherwise.
The transform pass lifts 1-D nodes to 2-D (``passes/conv1d.py``); transposed
and 3-D nodes cannot be lifted, and the plugin says so when they stay on CPU.
"""

from __future__ import annotations

from ..geometry import conv as geo

KERNEL_SPATIAL_DIMS = 2


def refusal(conv: geo.ConvBackward) -> str | None:
    """Why the CPU kernel cannot execute ``conv`` (as it is in the graph), or None."""
    why = []
    if conv.transposed:
        why.append("transposed")
    if conv.spatial_dims != KERNEL_SPATIAL_DIMS:
        why.append(f"{conv.spatial_dims}-D")
    return ", ".join(why) or None


def warning(node_name: str, why: str) -> str:
    """The one log line for a node that stays on CPU where no kernel can execute it."""
    return (
        f"convolution_backward {node_name}: stays on CPU, where executorch's CPU kernel "
        f"cannot execute it ({why}; it computes 2-D, non-transposed convolutions only): "
        "the program fails at run time"
    )
