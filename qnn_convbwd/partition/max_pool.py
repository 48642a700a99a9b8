"""Every "can this max_pool2d_with_indices_backward go to QNN?" decision.

Rules are small functions ``(node, pool, target) -> Rejection | None``, run in
order; the first rejection is logged as one line::

    max_pool2d_with_indices_backward <node>: not delegated: <reason> (<values>)

A node that stays on CPU is made right there by ``passes/max_pool_backward.py``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch

from ..geometry import pool as pg
from ..nodes import is_max_pool_backward  # noqa: F401 (its callers' name for it)
from .target import Target
from .verdict import Rejection, rules

logger = logging.getLogger(__name__)

OP = "max_pool2d_with_indices_backward"
# Measured with QAIRT 2.51 (docs/max_pool.md): V69 to V81 compile the window masks;
# V68 cannot create the float ElementWiseSelect ("could not create op: q::Select.exe").
MIN_HTP_ARCH = 69
FLOAT_DTYPES = (torch.float32, torch.float16)
# Window offsets become one Equal/Select/Pad/Add chain each: bound the graph size.
MAX_WINDOW = 49


def _rejection(rule: str, reason: str, values: str) -> Rejection:
    return Rejection(rule, reason, values, op=OP)


@dataclasses.dataclass(frozen=True)
class Decision:
    node: str
    pool: pg.MaxPoolBackward | None
    rejection: Rejection | None

    @property
    def supported(self) -> bool:
        return self.rejection is None


Rule = Callable[[torch.fx.Node, pg.MaxPoolBackward, Target], Rejection | None]
RULES, rule = rules(OP)


@rule
def backend_is_htp(node, pool, target):
    if not target.known:
        return _rejection("", "compile specs unknown: kept on CPU", "no compile specs")
    if target.backend != "htp":
        return _rejection("", "backend is not HTP", f"backend={target.backend}")
    return None


@rule
def htp_arch_supported(node, pool, target):
    if target.htp_arch is None or target.htp_arch < MIN_HTP_ARCH:
        return _rejection(
            "",
            f"HTP arch below V{MIN_HTP_ARCH} cannot compile the window masks' float Select",
            f"soc={target.soc}, arch=V{target.htp_arch}",
        )
    return None


@rule
def float_gradient(node, pool, target):
    if pool.dtype not in FLOAT_DTYPES:
        return _rejection("", "grad_output dtype is not float32 or float16", f"dtype={pool.dtype}")
    return None


@rule
def window_size(node, pool, target):
    count = 1
    for k in pool.kernel:
        count *= k
    if count > MAX_WINDOW:
        return _rejection(
            "",
            f"window of more than {MAX_WINDOW} elements (one op chain per element)",
            f"kernel_size={list(pool.kernel)}",
        )
    return None


def pooled_size(i: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    """torch's output size of one pooled dim (``pooling_output_shape`` in ATen)."""
    span = i + 2 * p - d * (k - 1) - 1
    out = (span + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= i + p:
        out -= 1  # the last window must start inside the input or its left padding
    return out


@rule
def windows_fit(node, pool, target):
    expected = [pooled_size(i, k, s, p, d, pool.ceil_mode) for i, _, k, s, p, d in pool.per_dim()]
    if expected != list(pool.out_sizes) or any(
        p > k // 2 for p, k in zip(pool.padding, pool.kernel)
    ):
        return _rejection(
            "",
            "grad_output size is not torch's pooled size of the input",
            f"input={list(pool.in_sizes)}, grad_output={list(pool.out_sizes)}, "
            f"expected={expected}, padding={list(pool.padding)}",
        )
    return None


def decide(node: torch.fx.Node, target: Target, log: bool = True) -> Decision:
    try:
        pool = pg.parse(node)
    except pg.PoolArgumentError as err:
        rejection = _rejection("parse", "arguments not understood", str(err))
        pool = None
    else:
        rejection = None
        for name, fn in RULES:
            found = fn(node, pool, target)
            if found is not None:
                rejection = dataclasses.replace(found, rule=name)
                break
    if rejection is not None and log:
        logger.info(
            rejection.message(node.name),
            extra={"convbwd_node": node.name, "convbwd_rule": rejection.rule},
        )
    return Decision(node.name, pool, rejection)
