"""Which nodes the plugin's rewrites into HTP ops cannot take, and why.

``passes/strided_scatter.py`` writes an ``as_strided_scatter`` whose view is a block
of its base as a reshape or a pad; ``passes/adaptive_pool.py`` writes adaptive
average pools and their backwards as products with static averaging matrices. A
node they leave has no visitor in executorch's QNN backend, and executorch 1.5.1's
runtime has no CPU kernel for ``as_strided_scatter`` or
``_adaptive_avg_pool2d_backward`` (``MISSING_CPU_KERNELS``): the rules
``strided_scatter_not_a_block`` and ``adaptive_pool_not_static`` keep it on CPU with
the reason these functions give, and ``judge`` warns that the program will not load.
"""

from __future__ import annotations

import torch

from .. import nodes
from ..geometry import strided

# Edge ops with no kernel among those executorch 1.5.1's runtime registers.
MISSING_CPU_KERNELS = ("as_strided_scatter", "_adaptive_avg_pool2d_backward")
# Argument positions of as_strided_scatter(self, src, size, stride, storage_offset).
BASE, SRC, SIZE, STRIDE, OFFSET = range(5)


def is_scatter(node: torch.fx.Node) -> bool:
    return nodes.is_call(node, nodes.edge_aten().as_strided_scatter.default)


def is_adaptive_pool(node: torch.fx.Node) -> bool:
    ops = nodes.edge_aten()
    return nodes.is_call(
        node, ops._adaptive_avg_pool2d.default, ops._adaptive_avg_pool2d_backward.default
    )


def missing_cpu_kernel(node: torch.fx.Node) -> bool:
    """True for an op executorch 1.5.1's runtime cannot run on CPU (listed here)."""
    name = getattr(node.target, "__name__", "")
    return any(name == f"aten.{op}.default" for op in MISSING_CPU_KERNELS)


def full_value(node: object) -> float | None:
    """The fill value of a ``full`` node (None for any other node)."""
    if nodes.is_call(node, nodes.edge_aten().full.default):
        return node.args[1]
    return None


def scatter_offset(node: torch.fx.Node) -> int:
    offset = node.args[OFFSET] if len(node.args) > OFFSET else None
    return 0 if offset is None else offset


def scatter_refusal(node: torch.fx.Node) -> str | None:
    """Why the ``as_strided_scatter`` ``node`` cannot be written as a reshape or a pad of
    its source (None: it can)."""
    base, src = node.args[BASE], node.args[SRC]
    base_value, src_value = base.meta["val"], src.meta["val"]
    size, stride, offset = list(node.args[SIZE]), list(node.args[STRIDE]), scatter_offset(node)
    numbers = [*size, *stride, offset, *base_value.shape, *src_value.shape]
    if not all(isinstance(n, int) for n in numbers):
        return f"dynamic shapes (size={size}, stride={stride}, offset={offset})"
    if not base_value.dtype.is_floating_point:
        return f"its base {base.name} is {base_value.dtype}, not floating point"
    if not base_value.is_contiguous():
        return f"its base {base.name} is not contiguous (stride {list(base_value.stride())})"
    if list(src_value.shape) != size:
        return f"its source {src.name} of shape {list(src_value.shape)} is not the view's {size}"
    try:
        found = strided.block(base_value.numel(), size, stride, offset)
    except strided.NotABlock as err:
        return str(err)
    if not found.covers and full_value(base) is None:
        return f"the view does not cover its base {base.name}, which is not a full"
    return None


def adaptive_pool_refusal(node: torch.fx.Node) -> str | None:
    """Why the adaptive average pool (or its backward) ``node`` cannot be written as
    products with averaging matrices (None: it can)."""
    shapes = [a.meta["val"].shape for a in node.args if isinstance(a, torch.fx.Node)]
    shapes.append(node.meta["val"].shape)
    if not all(isinstance(n, int) for shape in shapes for n in shape):
        return f"dynamic shapes ({', '.join(str(list(shape)) for shape in shapes)})"
    if not node.args[0].meta["val"].dtype.is_floating_point:
        return f"{node.args[0].name} is {node.args[0].meta['val'].dtype}, not floating point"
    return None
