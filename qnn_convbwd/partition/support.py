"""Every "can this convolution_backward go to QNN?" decision, in one place.

Each rule is a small function ``(node, conv, target) -> Rejection | None``. Rules
run in order; the first rejection is the node's reason. ``decide`` logs it as
exactly one line::

    convolution_backward <node>: not delegated: <reason> (<values>)

and the same text appears in ``qnn_convbwd.lower()``'s report. The visitor and
the passes never re-decide support: they ask ``decide``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch

from .. import integration
from ..builders import conv_geometry as geo
from .target import Target

logger = logging.getLogger(__name__)

MIN_HTP_ARCH = 69
FLOAT_DTYPES = (torch.float32, torch.float16)


@dataclasses.dataclass(frozen=True)
class Rejection:
    rule: str
    reason: str
    values: str

    def message(self, node_name: str) -> str:
        return f"convolution_backward {node_name}: not delegated: {self.reason} ({self.values})"


@dataclasses.dataclass(frozen=True)
class Decision:
    node: str
    conv: geo.ConvBackward | None
    rejection: Rejection | None

    @property
    def supported(self) -> bool:
        return self.rejection is None

    @property
    def reason(self) -> str:
        return "delegated" if self.rejection is None else self.rejection.reason


Rule = Callable[[torch.fx.Node, geo.ConvBackward, Target], Rejection | None]
RULES: list[tuple[str, Rule]] = []


def rule(fn: Rule) -> Rule:
    RULES.append((fn.__name__, fn))
    return fn


def _reject(reason: str, values: str) -> Rejection:
    # The rule name is filled in by decide(); rules only say why.
    return Rejection("", reason, values)


# --- target ----------------------------------------------------------------


@rule
def backend_is_htp(node, conv, target):
    if target.known and target.backend != "htp":
        return _reject("backend is not HTP", f"backend={target.backend}")
    return None


@rule
def htp_arch_supported(node, conv, target):
    if target.known and (target.htp_arch is None or target.htp_arch < MIN_HTP_ARCH):
        return _reject(
            f"HTP arch below V{MIN_HTP_ARCH} cannot compile the TransposeConv2d lowering",
            f"soc={target.soc}, arch=V{target.htp_arch}",
        )
    return None


# --- what is asked of the op -------------------------------------------------


@rule
def only_input_gradient(node, conv, target):
    if conv.output_mask != (True, False, False):
        return _reject(
            "output_mask asks for more than grad_input",
            f"output_mask={list(conv.output_mask)}",
        )
    return None


@rule
def not_transposed(node, conv, target):
    if conv.transposed:
        return _reject("backward of a transposed convolution", "transposed=True")
    return None


@rule
def two_spatial_dims(node, conv, target):
    if conv.rank != 4:
        return _reject("only rank-4 (2-D) convolutions", f"rank={conv.rank}")
    return None


@rule
def static_shapes(node, conv, target):
    if not conv.is_static:
        return _reject("dynamic shapes", f"grad_output={list(conv.grad_output_shape)}")
    return None


@rule
def no_dilation(node, conv, target):
    if any(d != 1 for d in conv.dilation):
        return _reject("dilation > 1", f"dilation={list(conv.dilation)}")
    return None


# --- operands ------------------------------------------------------------------


def _weight_node(node: torch.fx.Node) -> torch.fx.Node:
    return node.args[geo.WEIGHT]


@rule
def static_weight(node, conv, target):
    weight = _weight_node(node)
    if not integration.get("is_parameter")(weight, target.edge_program):
        kind = "graph input" if weight.op == "placeholder" else f"computed by {weight.op}"
        return _reject(
            "weight is not a parameter, buffer or constant of the program",
            f"weight={weight.name} is a {kind}",
        )
    return None


@rule
def float_operands(node, conv, target):
    weight = integration.get("get_parameter")(_weight_node(node), target.edge_program)
    if weight.dtype not in FLOAT_DTYPES or conv.dtype not in FLOAT_DTYPES:
        return _reject(
            "operands are not floating point",
            f"grad_output={conv.dtype}, weight={weight.dtype}",
        )
    return None


def _is_dequantize(node: torch.fx.Node) -> bool:
    target = getattr(node, "target", None)
    name = getattr(target, "__name__", "") or str(target)
    return node.op == "call_function" and "dequantize" in name


@rule
def not_quantized(node, conv, target):
    key = integration.get("QCOM_QUANT_ATTRS")
    for role, operand in (
        ("grad_output", node.args[geo.GRAD_OUTPUT]),
        ("weight", _weight_node(node)),
    ):
        if operand.meta.get(key):
            return _reject("quantized operand", f"{role}={operand.name} has {key}")
        if _is_dequantize(operand):
            return _reject("quantized operand", f"{role}={operand.name} is a dequantize")
    if node.meta.get(key):
        return _reject("quantized operand", f"node has {key}")
    return None


@rule
def expressible_output_padding(node, conv, target):
    op = conv.transposed_output_padding()
    if any(not 0 <= o < s for o, s in zip(op, conv.stride)):
        return _reject(
            "grad_input shape needs an output_padding outside [0, stride)",
            f"output_padding={list(op)}, stride={list(conv.stride)}",
        )
    return None


def decide(node: torch.fx.Node, target: Target, log: bool = True) -> Decision:
    """Run the rules on one node; log the rejection, if any, as one line."""
    try:
        conv = geo.parse(node)
    except geo.ConvArgumentError as err:
        rejection = Rejection("parse", "arguments not understood", str(err))
        conv = None
    else:
        rejection = None
        for name, fn in RULES:
            found = fn(node, conv, target)
            if found is not None:
                rejection = dataclasses.replace(found, rule=name)
                break
    if rejection is not None and log:
        logger.info(rejection.message(node.name))
    return Decision(node.name, conv, rejection)
