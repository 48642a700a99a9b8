"""pt2e-quantized models in training: a classifier's backbone quantized under a float
head (docs/quantized.md), and gradients through quantized layers.

``quantize_backbone`` splits a classifier at its head (the top-level child holding the
layer that gives the classes), exports the rest in ``eval()`` (batch norms then fold
into the convolutions in ``prepare_pt2e``), calibrates it on the batches given and
converts it (``convert_pt2e``): convolution weights int8 per output channel,
activations 8 or 16 bits per tensor. The head is the float module itself, and its
parameters alone require a gradient.

The straight-through estimator. A model converted with pt2e (``prepare_pt2e`` /
``convert_pt2e``) computes every activation as
``dequantize_per_tensor(quantize_per_tensor(x))``. The quantize returns an integer
tensor, so no gradient flows through it: a trainable parameter before or inside the
quantized part gets none, and
``torch.export.experimental._export_forward_backward`` fails with "Found a parameter
that did not receive a gradient".

``straight_through(module)`` replaces each such pair by ``straight_through_quantize``
(the op ``qnn_convbwd::straight_through_quantize``) with the pair's parameters. Its
forward runs the pair itself, so its values are the pair's bit for bit; its backward
is quantization-aware training's straight-through estimator, the backward of
``torch.fake_quantize_per_tensor_affine``: the gradient passes where
``round(x / scale) + zero_point`` lies inside ``[quant_min, quant_max]`` and is zero
where the quantize clamps (``straight_through_bounds``: the same mask, exactly).
``torch.fake_quantize_per_tensor_affine`` itself is not used: its forward differs from
the pair at rounding ties (it multiplies by ``1.0f / float(scale)``, the quantize by
``float(1.0 / scale)``; measured on 310 tie points of one scale, 110 came out one step
apart). Weights stay ``dequantize_per_channel`` of their integer constants: frozen,
no gradient.

``training.lower_for_training`` applies it to a copy of the module it is given when
the module holds such pairs; ``passes.straight_through`` turns the op in the joint graph
back into the quantize / dequantize pair executorch's Qualcomm passes fold into
quantization metadata, so the forward stays on the HTP's integer path; the backward is
already comparisons and a select.
"""

from __future__ import annotations

import copy
import hashlib
import logging
from collections.abc import Iterable, Sequence

import torch
from torch import nn

logger = logging.getLogger(__name__)

# QnnQuantizer's QuantDtype member for each quantization offered.
SCHEMES = {"8a8w": "use_8a8w", "16a8w": "use_16a8w"}
# The largest batch the quantized backbone takes.
BATCH_LIMIT = 4096


class QuantizationError(ValueError):
    """A model that cannot be split or quantized; the message says which and why."""


class QuantizedBackbone(nn.Module):
    """``head(flatten(backbone(x), 1))``: a converted pt2e backbone, frozen, and the float
    head under the attribute the original model gave it (``head_name``).

    ``train()`` / ``eval()`` set the head's mode alone: the converted backbone computes
    as the model did in ``eval()`` (its batch norms folded), whatever the mode."""

    def __init__(
        self,
        backbone: nn.Module,
        head: nn.Module,
        head_name: str,
        float_modules: Sequence[str] = (),
    ) -> None:
        super().__init__()
        self.backbone = backbone
        self.head_name = head_name
        # modules of the backbone left float and trainable (``quantize_backbone``)
        self.float_modules = tuple(float_modules)
        setattr(self, head_name, head)

    @property
    def head(self) -> nn.Module:
        return getattr(self, self.head_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.backbone(x), 1))

    def train(self, mode: bool = True) -> QuantizedBackbone:
        self.training = mode
        self.head.train(mode)
        return self


def quantizer(scheme: str, *, qat: bool = False, per_channel: bool = True):
    """executorch's ``QnnQuantizer`` for ``scheme`` (``SCHEMES``), convolution weights per
    output channel unless ``per_channel`` is False, with fake quantization for
    quantization-aware training when ``qat``.

    The QNN SDK is made usable first (``ensure_sdk``): building a ``QnnQuantizer`` in a
    process without ``QNN_SDK_ROOT`` has executorch download an SDK and libc++, which
    fails offline with tracebacks on the console."""
    from executorch.backends.qualcomm.quantizer.quantizer import QnnQuantizer, QuantDtype

    from .toolchain import SdkUnavailable, ensure_sdk

    if scheme not in SCHEMES:
        raise QuantizationError(f"quantization {scheme!r}: one of {', '.join(SCHEMES)}")
    try:
        ensure_sdk()
    except SdkUnavailable as error:  # quantizing needs no SDK; executorch then looks itself
        logger.info("quantizing without a QNN SDK of the plugin's: %s", error)
    chosen = QnnQuantizer()
    chosen.set_default_quant_config(
        getattr(QuantDtype, SCHEMES[scheme]), is_qat=qat, is_conv_per_channel=per_channel
    )
    return chosen


def head_child(net: nn.Module, head: str) -> str:
    """The top-level child of ``net`` that holds the module named ``head`` (the layer
    giving the classes): ``fc`` for a ResNet, ``classifier`` for MobileNetV2 or the
    CIFAR example. The model's forward must end with it, after a flatten."""
    top = head.split(".", 1)[0]
    if top not in dict(net.named_children()):
        raise QuantizationError(f"{type(net).__name__}: no child {top!r} holding the head {head!r}")
    return top


def backbone_of(net: nn.Module, top: str) -> nn.Module:
    """A copy of ``net`` whose child ``top`` (the head) is ``nn.Identity``: the backbone,
    computing the features the head reads."""
    backbone = copy.deepcopy(net)
    setattr(backbone, top, nn.Identity())
    return backbone


def quantize_backbone(
    net: nn.Module,
    head: str,
    scheme: str,
    calibration: Iterable[torch.Tensor],
    float_modules: Sequence[str] = (),
) -> QuantizedBackbone:
    """``net``'s backbone quantized with ``scheme`` after calibration on the input batches
    ``calibration`` (all of one shape), under a copy of its float head (the child of
    ``net`` holding the module named ``head``; ``head_child``). The head keeps ``net``'s
    mode, the backbone computes as in ``eval()``. ``net`` is left as it was.

    ``float_modules``: modules of the backbone (names in ``net``, such as a
    ``finetune.ResidualAdapter``'s ``layer2.adapter``) left unquantized and trainable
    inside it (``float_nodes``). Only their parameters and the head's require a
    gradient."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    top = head_child(net, head)
    batches = list(calibration)
    if not batches:
        raise QuantizationError("no calibration batch: the backbone cannot be quantized")
    backbone = backbone_of(net, top).eval()
    chosen = quantizer(scheme)
    with torch.no_grad():
        try:
            # Any batch size: the program's is fixed when it is lowered, an evaluation's
            # or an inference program's may be another.
            exported = torch.export.export(
                backbone,
                (batches[0],),
                dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=BATCH_LIMIT)},),
                strict=True,
            ).module()
        except Exception as err:  # whatever torch.export raises on the model
            raise QuantizationError(
                f"{type(net).__name__}: its backbone (without {top!r}) does not export "
                f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
            ) from None
        if float_modules:
            chosen.add_discard_nodes([n.name for n in float_nodes(exported, float_modules)])
        prepared = prepare_pt2e(exported, chosen)
        for batch in batches:
            prepared(batch)
        converted = convert_pt2e(prepared)
    _drop_unread_state(converted)
    model = QuantizedBackbone(converted, copy.deepcopy(getattr(net, top)), top, float_modules)
    model.train(net.training)
    trains = (top + ".", *(f"backbone.{m}." for m in float_modules))
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name.startswith(trains))
    logger.info(
        "quantized %s's backbone (%s) on %d calibration batch(es)%s",
        type(net).__name__,
        scheme,
        len(batches),
        f", {len(float_modules)} module(s) left float" if float_modules else "",
    )
    return model


def _innermost_module(node: torch.fx.Node) -> str | None:
    """The path of the module whose forward computes ``node`` (the last entry of its
    ``nn_module_stack``), ``""`` for the top level, None when the node has no stack."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path = str(list(stack.values())[-1][0])
    # strict export writes L['self'].a.b, or the plain dotted path
    return path.removeprefix("L['self']").removeprefix(".")


def float_nodes(
    exported: torch.fx.GraphModule, float_modules: Sequence[str]
) -> list[torch.fx.Node]:
    """The nodes of the exported backbone ``exported`` to leave unquantized for
    ``float_modules``: those computed inside one of the modules, and the glue around
    one that reads its output inside the module holding it (a residual
    ``y + adapter(y)`` of the adapter's parent), so that what a float module adds to the
    backbone is joined in float and quantized once, where the next quantized op reads
    it. Raises ``QuantizationError`` for a module that computes no node, and for one
    whose output a batch norm reads (it would not fold into its convolution)."""
    modules = list(float_modules)
    inside = {
        n
        for n in exported.graph.nodes
        if (path := _innermost_module(n)) is not None
        and any(path == m or path.startswith(m + ".") for m in modules)
    }
    computed = {
        m
        for m in modules
        for n in inside
        if (p := _innermost_module(n)) is not None and (p == m or p.startswith(m + "."))
    }
    missing = [m for m in modules if m not in computed]
    if missing:
        raise QuantizationError(f"no node of the backbone is computed by {', '.join(missing)}")
    parents = {m.rpartition(".")[0] for m in modules}
    found = set(inside)
    frontier = list(inside)
    while frontier:
        for user in frontier.pop().users:
            if user not in found and _innermost_module(user) in parents:
                found.add(user)
                frontier.append(user)
    norms = {
        torch.ops.aten.batch_norm.default,
        torch.ops.aten._native_batch_norm_legit_no_training.default,
    }
    for node in found:
        for user in node.users:
            if user not in found and user.target in norms:
                raise QuantizationError(
                    f"batch norm {user.name} ({_innermost_module(user)}) reads "
                    f"{node.name}, computed in float by {', '.join(modules)}: a float "
                    "module between a convolution and its batch norm keeps the batch norm "
                    "from folding into the convolution, and QNN takes no unfolded quantized "
                    "batch norm; put the module after the batch norm"
                )
    return [n for n in exported.graph.nodes if n in found]


def _drop_unread_state(module: torch.fx.GraphModule) -> None:
    """Delete the parameters and buffers ``module``'s graph does not read: the float
    originals of the weights ``convert_pt2e`` quantized, which it keeps as attributes.
    The module's state is then what a program lowered from it holds."""
    read = {str(n.target) for n in module.graph.nodes if n.op == "get_attr"}
    unread = [
        name
        for name, _ in [*module.named_parameters(), *module.named_buffers()]
        if name not in read
    ]
    for name in unread:
        owner, _, attribute = name.rpartition(".")
        delattr(module.get_submodule(owner) if owner else module, attribute)


def int8_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The converted model's int8 convolution weights (its quantized constants)."""
    return {
        name: value
        for name, value in model.named_buffers()
        if value.dtype == torch.int8 and value.dim() == 4
    }


def digest(model: QuantizedBackbone) -> str:
    """SHA-256 of the converted backbone: its graph's code (the activations' scales and
    zero points are literals there) and every tensor it holds but the parameters of its
    float modules, which train. Two quantizations of the same weights on the same
    calibration batches have the same digest."""
    hashed = hashlib.sha256(model.backbone.code.encode())
    trained = tuple(m + "." for m in model.float_modules)
    for name, value in sorted(model.backbone.state_dict().items()):
        if name.startswith(trained):  # what trains inside the backbone is not its identity
            continue
        hashed.update(name.encode())
        hashed.update(value.detach().contiguous().view(torch.uint8).numpy().tobytes())
    for name, value in sorted(_tensor_attributes(model.backbone).items()):
        hashed.update(name.encode())
        hashed.update(value.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return hashed.hexdigest()


def _tensor_attributes(module: nn.Module) -> dict[str, torch.Tensor]:
    """Tensors the graph reads as plain attributes (``get_attr`` targets that are neither
    parameters nor buffers)."""
    found: dict[str, torch.Tensor] = {}
    if not isinstance(module, torch.fx.GraphModule):
        return found
    for node in module.graph.nodes:
        if node.op != "get_attr":
            continue
        value = module
        for part in str(node.target).split("."):
            value = getattr(value, part)
        if isinstance(value, torch.Tensor):
            found[str(node.target)] = value
    return found


# The full 8- and 16-bit ranges the estimator takes, each with its integer dtype (a
# quantizer may store a range in a wider dtype: QnnQuantizer's 16-bit activations are
# int32 tensors over [0, 65535]).
RANGE_DTYPES: dict[tuple[int, int], torch.dtype] = {
    (0, 255): torch.uint8,
    (-128, 127): torch.int8,
    (0, 65535): torch.uint16,
    (-32768, 32767): torch.int16,
}


class StraightThroughError(ValueError):
    """A quantize / dequantize pair the straight-through rewrite cannot take."""


def _quantize_ops() -> tuple | None:
    """pt2e's quantize and dequantize ops, as whoever converted the model registered
    them (torchao, or torch.ao: their kernels differ); None when none did."""
    ops = torch.ops.quantized_decomposed
    try:
        return ops.quantize_per_tensor.default, ops.dequantize_per_tensor.default
    except AttributeError:
        return None


def _graph_modules(module: torch.nn.Module) -> list[torch.fx.GraphModule]:
    return [m for m in module.modules() if isinstance(m, torch.fx.GraphModule)]


def activation_pairs(module: torch.nn.Module) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """Every (quantize_per_tensor, dequantize_per_tensor) pair of the graph modules in
    ``module`` (a dequantize reading a quantize)."""
    found = _quantize_ops()
    if found is None:
        return []
    quantize, dequantize = found
    return [
        (node.args[0], node)
        for graph_module in _graph_modules(module)
        for node in graph_module.graph.nodes
        if node.op == "call_function"
        and node.target == dequantize
        and isinstance(node.args[0], torch.fx.Node)
        and node.args[0].target == quantize
    ]


def _parameters(quantize: torch.fx.Node, dequantize: torch.fx.Node) -> tuple:
    """(scale, zero_point, quant_min, quant_max) of a pair, checked."""
    q_args, dq_args = tuple(quantize.args[1:6]), tuple(dequantize.args[1:6])
    if q_args != dq_args:
        raise StraightThroughError(
            f"{dequantize.name}: dequantizes {quantize.name} with other parameters "
            f"({list(dq_args)} against {list(q_args)})"
        )
    scale, zero_point, quant_min, quant_max, dtype = q_args
    holds = (
        isinstance(dtype, torch.dtype)
        and not dtype.is_floating_point
        and dtype != torch.bool
        and torch.iinfo(dtype).min <= quant_min
        and quant_max <= torch.iinfo(dtype).max
    )
    if (quant_min, quant_max) not in RANGE_DTYPES or not holds:
        known = ", ".join(f"[{lo}, {hi}]" for lo, hi in RANGE_DTYPES)
        raise StraightThroughError(
            f"{quantize.name}: {dtype} over [{quant_min}, {quant_max}] is not a full 8- or "
            f"16-bit range the lowering knows ({known}) in an integer dtype that holds it"
        )
    if not isinstance(scale, float) or not isinstance(zero_point, int):
        raise StraightThroughError(
            f"{quantize.name}: scale and zero point must be numbers of the graph, "
            f"not {type(scale).__name__} and {type(zero_point).__name__}"
        )
    return scale, zero_point, quant_min, quant_max


def straight_through(module: torch.nn.Module) -> int:
    """Replace, in place, each activation's quantize / dequantize pair of the pt2e graph
    modules in ``module`` with ``straight_through_quantize`` (the same forward values;
    the straight-through estimator's backward). Returns how many pairs.

    Every pair is checked before anything changes; a pair with different parameters on
    its two halves, a range other than a full 8- or 16-bit one, or tensor-valued
    parameters raises ``StraightThroughError`` naming the node. A quantize whose value is
    read by anything but dequantizes is refused the same way (that reader would need
    the integer tensor).
    """
    pairs = activation_pairs(module)
    plans = {}
    for quantize, dequantize in pairs:
        others = [u.name for u in quantize.users if u.target != dequantize.target]
        if others:
            raise StraightThroughError(
                f"{quantize.name}: its integer tensor is also read by {others}"
            )
        plans[dequantize] = _parameters(quantize, dequantize)
    changed = set()
    for (quantize, dequantize), parameters in zip(pairs, plans.values()):
        graph = dequantize.graph
        low, high = straight_through_bounds(*parameters)
        with graph.inserting_before(dequantize):
            fake = graph.call_function(
                torch.ops.qnn_convbwd.straight_through_quantize.default,
                (quantize.args[0], *parameters, quantize.args[5], low, high),
            )
        fake.meta.update({k: v for k, v in dequantize.meta.items() if k != "val"})
        if "val" in dequantize.meta:
            fake.meta["val"] = dequantize.meta["val"]
        dequantize.replace_all_uses_with(fake)
        graph.erase_node(dequantize)
        if not quantize.users:
            graph.erase_node(quantize)
        changed.add(graph)
    for graph_module in _graph_modules(module):
        if graph_module.graph in changed:
            graph_module.recompile()
    if pairs:
        logger.info("straight-through estimator: %d quantize / dequantize pairs", len(pairs))
    return len(pairs)


def holds_activation_pairs(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds pt2e activation quantize / dequantize pairs."""
    return bool(activation_pairs(module))


def _in_range(values: torch.Tensor, scale: float, zero_point: int, quant_min: int, quant_max: int):
    """torch's own straight-through mask of ``values`` (fp32)."""
    _, mask = torch.ops.aten.fake_quantize_per_tensor_affine_cachemask.default(
        values, scale, zero_point, quant_min, quant_max
    )
    return mask


def _first_float_where(predicate, around: float, rising: bool) -> float:
    """The smallest fp32 value near ``around`` where ``predicate`` turns True (``rising``)
    or the largest where it is still True (not ``rising``); ``predicate`` is monotone."""
    width = 64
    while True:
        centre = torch.tensor(around, dtype=torch.float32)
        steps = torch.arange(-width, width + 1, dtype=torch.int32)
        bits = centre.view(torch.int32) + steps  # neighbouring fp32 values
        values = bits.view(torch.float32).sort().values
        inside = predicate(values)
        if rising and not inside[0] and inside[-1]:
            return float(values[int(inside.int().argmax())])
        if not rising and inside[0] and not inside[-1]:
            return float(values[int((~inside).int().argmax()) - 1])
        width *= 4
        if width > 1 << 24:
            raise StraightThroughError(f"no fp32 bound of the quantize range near {around}")


def straight_through_bounds(
    scale: float, zero_point: int, quant_min: int, quant_max: int
) -> tuple[float, float]:
    """``(low, high)``: the fp32 interval where the straight-through estimator passes the
    gradient. For every finite fp32 ``x``, ``low <= x <= high`` exactly when torch's
    ``fake_quantize_per_tensor_affine`` leaves ``x`` unclamped
    (``quant_min <= round(x / scale) + zero_point <= quant_max``, computed as torch
    computes it)."""

    def inside(values: torch.Tensor) -> torch.Tensor:
        return _in_range(values, scale, zero_point, quant_min, quant_max)

    low = _first_float_where(inside, (quant_min - zero_point - 0.5) * scale, rising=True)
    high = _first_float_where(inside, (quant_max - zero_point + 0.5) * scale, rising=False)
    return low, high


# --- the op -------------------------------------------------------------------------------


@torch.library.custom_op("qnn_convbwd::straight_through_quantize", mutates_args=())
def straight_through_quantize(
    x: torch.Tensor,
    scale: float,
    zero_point: int,
    quant_min: int,
    quant_max: int,
    dtype: torch.dtype,
    low: float,
    high: float,
) -> torch.Tensor:
    """``dequantize_per_tensor(quantize_per_tensor(x))`` with pt2e's ops; its gradient is
    the incoming one where ``low <= x <= high`` (``straight_through_bounds``), else 0."""
    quantize, dequantize = _quantize_ops()
    parameters = (scale, zero_point, quant_min, quant_max, dtype)
    return dequantize(quantize(x, *parameters), *parameters)


@straight_through_quantize.register_fake
def _(x, scale, zero_point, quant_min, quant_max, dtype, low, high):
    return torch.empty_like(x)


def _setup(ctx, inputs, output) -> None:
    x, *_, low, high = inputs
    ctx.save_for_backward(x)
    ctx.low, ctx.high = low, high


def _backward(ctx, grad: torch.Tensor):
    (x,) = ctx.saved_tensors
    inside = torch.logical_and(torch.ge(x, ctx.low), torch.le(x, ctx.high))
    passed = torch.where(inside, grad, torch.zeros((), dtype=grad.dtype))
    return passed, None, None, None, None, None, None, None


straight_through_quantize.register_autograd(_backward, setup_context=_setup)
