"""Train-mode dropout as a counter-based draw on CPU and a mask product on the HTP.

A joint graph of a model in ``train()`` draws its dropout masks with
``aten.native_dropout`` (``nn.Dropout``, ``F.dropout``) or ``aten.bernoulli.p`` on an
empty tensor (``inplace=True``, ``Dropout2d``'s channel masks, torchvision's stochastic
depth). executorch 1.5.1 has no ``bernoulli`` kernel, its portable ``native_dropout``
does not scale the kept values, and QNN has no visitor for either: the op stays on CPU
in the middle of the graph and splits it into several delegates. ``rewrite`` replaces
each draw with:

* a **step counter**, an int32 buffer of the program (``STEP_BUFFER``) that the program
  increments on every call (a buffer mutation, so the runtime keeps it between steps);
* a **keyed hash** of ``(element index, step)`` under a per-site key derived from the
  seed, in int32 ops executorch's portable CPU kernels run: ``ROUNDS`` rounds of a
  Philox-style multiply/xor network on 16-bit words (``keep``). Every product is a
  16-bit word times a 15-bit multiplier and every sum stays below 2**31, so no int32
  operation overflows and torch and executorch compute the same bits. The top 24
  bits of the result, compared with ``round(p * 2**24)``, decide each element;
* the **mask product**: ``x * (mask * 1 / (1 - p))``; the joint graph's backward
  ``grad * (mask * scale)`` reads the same scaled mask (``share_backward_mask``), so
  the CPU casts each mask once and the delegate receives it once.

The counter and everything computed from it alone is the program's state, which the
partition rule ``program_state_on_cpu`` keeps on CPU: the draw is an input of the
delegate, and the products run on the HTP with the rest of the graph. A fresh step
gives fresh masks; the same seed gives the same masks at the same step.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import operator
import random
from collections.abc import Callable

import torch
from torch.export.graph_signature import (
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
    TensorArgument,
)
from torch.utils._python_dispatch import TorchDispatchMode

from .. import integration

logger = logging.getLogger(__name__)

aten = torch.ops.aten

STEP_BUFFER = "qnn_convbwd_dropout_step"
ROUNDS = 10
# Multipliers of the two word pairs: odd and below 2**15, so a product with a 16-bit
# word stays below 2**31.
MULTIPLIERS = (0x7A6D, 0x5C3B)
WORD = 0xFFFF
# The counter wraps at 2**30: ``(step & STEP_MASK) + 1`` cannot overflow.
STEP_MASK = (1 << 30) - 1
UNIFORM_BITS = 24


@dataclasses.dataclass(frozen=True)
class Site:
    """One dropout draw of the program."""

    node: str  # the rewritten node
    shape: tuple[int, ...]
    keep: float  # probability of keeping an element
    scale: float | None  # native_dropout's 1 / (1 - p); None for bernoulli (a 0/1 mask)
    key: tuple[int, ...]  # 2 * ROUNDS 16-bit round keys


def round_keys(seed: int, site: int) -> tuple[int, ...]:
    """The 16-bit round keys of draw number ``site`` under ``seed``."""
    draw = random.Random(seed * 1_000_003 + site)
    return tuple(draw.getrandbits(16) for _ in range(2 * ROUNDS))


def threshold(keep: float) -> int:
    """An element is kept when its 24-bit value is below this."""
    return round(keep * (1 << UNIFORM_BITS))


Call = Callable[..., object]


class _Ops:
    """The integer ops of the hash through ``call``. Masks and shifts take their operand
    as an int32 ``full`` (one per value): executorch's QNN pass that lifts scalar
    operands into tensors knows no bitwise op but xor, and prints a warning for each."""

    def __init__(self, call: Call) -> None:
        self.call = call
        self.constants: dict[int, object] = {}

    def constant(self, value: int):
        if value not in self.constants:
            self.constants[value] = self.call(aten.full.default, [], value, dtype=torch.int32)
        return self.constants[value]

    def mask(self, x, bits: int):
        return self.call(aten.bitwise_and.Tensor, x, self.constant(bits))

    def shift(self, x, count: int):
        return self.call(aten.bitwise_right_shift.Tensor, x, self.constant(count))


def keep(call: Call, step, shape: tuple[int, ...], key: tuple[int, ...], keep_p: float):
    """The bool keep-mask of ``shape`` at counter ``step`` (a 0-d int32 tensor or node).

    ``call(op, *args, **kwargs)`` applies an ATen op: eagerly (``eager``) or by adding
    a node to a graph, so the program and a reference compute the same ops.
    """
    ops = _Ops(call)
    numel = 1
    for size in shape:
        numel *= size
    index = call(aten.arange.start_step, 0, numel, 1, dtype=torch.int32)
    step = ops.mask(step, STEP_MASK)
    words = [ops.mask(index, WORD), ops.shift(index, 16), ops.mask(step, WORD), ops.shift(step, 16)]
    for r in range(ROUNDS):
        products = [
            call(aten.mul.Scalar, words[0], MULTIPLIERS[0]),
            call(aten.mul.Scalar, words[2], MULTIPLIERS[1]),
        ]
        high = [ops.shift(p, 16) for p in products]
        low = [ops.mask(p, WORD) for p in products]
        keyed = [
            call(aten.bitwise_xor.Scalar, words[1], key[2 * r]),
            call(aten.bitwise_xor.Scalar, words[3], key[2 * r + 1]),
        ]
        words = [
            call(aten.bitwise_xor.Tensor, high[1], keyed[0]),
            low[1],
            call(aten.bitwise_xor.Tensor, high[0], keyed[1]),
            low[0],
        ]
    # 24 bits: the first word and the top half of the second (< 2**24, no overflow).
    uniform = call(aten.add.Tensor, call(aten.mul.Scalar, words[0], 1 << 8), ops.shift(words[1], 8))
    kept = call(aten.lt.Scalar, uniform, threshold(keep_p))
    return call(aten.view.default, kept, list(shape))


def eager(op, *args, **kwargs):
    """``call`` for ``keep`` that runs the op."""
    return op(*args, **kwargs)


def site_mask(site: Site, step: int) -> torch.Tensor:
    """The bool keep-mask the program draws at ``site`` when its counter is ``step``."""
    return keep(eager, torch.tensor(step, dtype=torch.int32), site.shape, site.key, site.keep)


class ProgramMasks(TorchDispatchMode):
    """Torch eager dropping the elements a rewritten program drops at counter ``step``.

    Inside the mode, the n-th random draw of the eager forward (``bernoulli_``, which
    CPU dropout, ``Dropout2d`` and stochastic depth all call) is filled with the keep-mask
    of the program's n-th random site (``site_mask``); sites whose mask is a constant
    (p 0 or 1) draw nothing on either side. A draw whose shape or probability differs
    from its site's, or a count that differs, is an error: the masks would not line up.
    """

    def __init__(self, sites: list[Site], step: int) -> None:
        super().__init__()
        self.sites = [site for site in sites if site.key]
        self.step = step
        self.drawn = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not aten.bernoulli_.float:
            return func(*args, **kwargs)
        target, p = args[0], args[1] if len(args) > 1 else kwargs.get("p", 0.5)
        if self.drawn >= len(self.sites):
            raise ValueError(
                f"eager draw {self.drawn} (bernoulli_ of shape {tuple(target.shape)}): the "
                f"program has {len(self.sites)} random dropout site(s)"
            )
        site = self.sites[self.drawn]
        if tuple(target.shape) != site.shape or abs(float(p) - site.keep) > 1e-6:
            raise ValueError(
                f"eager draw {self.drawn} (bernoulli_ of shape {tuple(target.shape)}, keep "
                f"{float(p):g}) does not match the program's site {site.node} (shape "
                f"{site.shape}, keep {site.keep:g})"
            )
        self.drawn += 1
        return target.copy_(site_mask(site, self.step))

    def __exit__(self, kind, value, traceback):
        result = super().__exit__(kind, value, traceback)
        if kind is None and self.drawn != len(self.sites):
            raise ValueError(
                f"the eager forward drew {self.drawn} dropout mask(s), the program "
                f"{len(self.sites)}: the masks would not line up"
            )
        return result


# --- the graph rewrite ------------------------------------------------------------------


def _is(node: torch.fx.Node, op) -> bool:
    return node.op == "call_function" and node.target == op


def _dropout_p(node: torch.fx.Node) -> float | None:
    """The drop probability of a train-mode ``native_dropout`` (None: not one)."""
    if not _is(node, aten.native_dropout.default):
        return None
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train")
    if train is False or train is None:
        return None  # eval-mode: the identity, executorch's kernel is right
    return float(node.args[1])


def _bernoulli_p(node: torch.fx.Node) -> float | None:
    """The keep probability of ``bernoulli.p(t, p)`` (t's values are not read)."""
    if not _is(node, aten.bernoulli.p):
        return None
    if node.kwargs.get("generator") is not None:
        return None
    return float(node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5))


# The dropout ops of a program in torch.export's training IR (``export`` before
# ``run_decompositions``): torch's own decomposition turns them into ``native_dropout``
# or ``bernoulli.p`` (alpha dropout: a bernoulli mask inside an affine map).
COMPOSITE_DROPOUTS = (
    aten.dropout.default,
    aten.dropout_.default,
    aten.feature_dropout.default,
    aten.feature_dropout_.default,
    aten.alpha_dropout.default,
    aten.alpha_dropout_.default,
    aten.feature_alpha_dropout.default,
    aten.feature_alpha_dropout_.default,
)


def _composite_in_train_mode(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or node.target not in COMPOSITE_DROPOUTS:
        return False
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train")
    return train is True


def draw_nodes(program: torch.export.ExportedProgram) -> list[torch.fx.Node]:
    """The random draws ``rewrite`` replaces, in graph order."""
    return [
        n for n in program.graph.nodes if _dropout_p(n) is not None or _bernoulli_p(n) is not None
    ]


class _Emitter:
    """``call`` for ``keep`` that inserts nodes (with their fake values) into a graph."""

    def __init__(self, graph: torch.fx.Graph, fake_mode, meta: dict) -> None:
        self.graph = graph
        self.fake_mode = fake_mode
        self.meta = meta

    def __call__(self, op, *args, **kwargs) -> torch.fx.Node:
        node = self.graph.call_function(op, args, kwargs)
        fake = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
        with self.fake_mode:
            node.meta["val"] = op(*fake[0], **fake[1])
        node.meta.update(self.meta)
        return node


def emit_step_update(call: Call, step):
    """The counter's next value, ``(step & STEP_MASK) + 1``."""
    return call(aten.add.Scalar, _Ops(call).mask(step, STEP_MASK), 1)


def draws(program: torch.export.ExportedProgram) -> bool:
    """Whether ``rewrite`` replaces anything in ``program``: whether it draws a seed when
    given none."""
    return any(_composite_in_train_mode(n) for n in program.graph.nodes) or bool(
        draw_nodes(program)
    )


def fresh_seed() -> int:
    """A seed from torch's RNG, drawn as ``rewrite`` draws one when given none."""
    return _seed(None)


def _seed(seed: int | None) -> int:
    if seed is not None:
        return int(seed)
    return int(torch.randint(0, 2**31 - 1, ()).item())


def _add_step_buffer(program: torch.export.ExportedProgram, fake_mode) -> torch.fx.Node:
    """A 0-d int32 buffer ``STEP_BUFFER`` (starting at 0), read as a placeholder and
    written back as ``(step & STEP_MASK) + 1``; returns the placeholder."""
    graph = program.graph
    signature = program.graph_signature
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    # Parameters and buffers come first among the inputs: the buffer goes after them.
    position = next(
        (
            i
            for i, spec in enumerate(signature.input_specs)
            if spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER)
        ),
        len(signature.input_specs),
    )
    name = "b_" + STEP_BUFFER
    if position < len(placeholders):
        with graph.inserting_before(placeholders[position]):
            step = graph.placeholder(name)
    else:
        with graph.inserting_after(placeholders[-1]) if placeholders else graph.inserting_before():
            step = graph.placeholder(name)
    initial = torch.zeros((), dtype=torch.int32)
    step.meta["val"] = fake_mode.from_tensor(initial)
    signature.input_specs.insert(
        position,
        InputSpec(InputKind.BUFFER, TensorArgument(step.name), STEP_BUFFER, persistent=True),
    )
    program.state_dict[STEP_BUFFER] = initial

    output = graph.output_node()
    with graph.inserting_before(output):
        following = emit_step_update(_Emitter(graph, fake_mode, {}), step)
    values = list(output.args[0])
    # Buffer mutations come first among the outputs.
    output.args = ((following, *values),)
    signature.output_specs.insert(
        0, OutputSpec(OutputKind.BUFFER_MUTATION, TensorArgument(following.name), STEP_BUFFER)
    )
    return step


def rewrite(
    program: torch.export.ExportedProgram, seed: int | None = None
) -> tuple[torch.export.ExportedProgram, list[Site]]:
    """A copy of ``program`` with its dropout draws replaced (``program`` itself, and no
    sites, when it has none); ``seed`` None draws one from torch's RNG. A program in
    torch.export's training IR has its train-mode dropout ops decomposed first."""
    if any(_composite_in_train_mode(n) for n in program.graph.nodes):
        program = program.run_decompositions({})  # a new program: the caller's is unchanged
    elif draw_nodes(program):
        program = copy.deepcopy(program)
    if not draw_nodes(program):
        return program, []
    seed = _seed(seed)
    graph = program.graph
    found = draw_nodes(program)
    fake_mode = integration.get("detect_fake_mode")(
        [n.meta["val"] for n in graph.nodes if n.op == "placeholder"]
    )
    step = None
    sites = []
    for node in found:
        dropped = _dropout_p(node)
        keep_p = 1.0 - dropped if dropped is not None else _bernoulli_p(node)
        like = node.args[0].meta["val"]
        shape = tuple(int(s) for s in like.shape)
        meta = {k: node.meta[k] for k in ("stack_trace", "nn_module_stack") if k in node.meta}
        with graph.inserting_before(node):
            emit = _Emitter(graph, fake_mode, meta)
            if keep_p in (0.0, 1.0):
                kept = emit(aten.full.default, list(shape), keep_p == 1.0, dtype=torch.bool)
                key: tuple[int, ...] = ()
            else:
                if step is None:
                    with graph.inserting_before(node):
                        step = _add_step_buffer(program, fake_mode)
                key = round_keys(seed, len(sites))
                kept = keep(emit, step, shape, key, keep_p)
            mask = emit(aten._to_copy.default, kept, dtype=like.dtype)
            if dropped is None:
                node.replace_all_uses_with(mask)
                scale = None
                operand = node.args[0]
            else:
                scale = 1.0 / (1.0 - dropped) if dropped < 1.0 else 0.0
                scaled = emit(aten.mul.Tensor, mask, scale) if scale not in (0.0, 1.0) else mask
                out = emit(aten.mul.Tensor, node.args[0], scaled)
                _replace_outputs(node, out, kept)
                share_backward_mask(kept, mask, scaled, scale)
        graph.erase_node(node)
        if dropped is None and operand.op == "call_function" and not operand.users:
            graph.erase_node(operand)  # the empty tensor bernoulli drew into
        sites.append(Site(node.name, shape, keep_p, scale, key))
    program.graph_module.recompile()
    logger.info(
        "dropout: %d draws as a counter-based hash on CPU (seed %d), the masks applied "
        "on the delegate",
        len(sites),
        seed,
    )
    return program, sites


def share_backward_mask(
    kept: torch.fx.Node, mask: torch.fx.Node, scaled: torch.fx.Node, scale: float
) -> int:
    """The joint graph's backward of a dropout casts its keep-mask and scales it again
    (torch's decomposition of ``native_dropout_backward``: ``grad * (mask.to(dtype) *
    scale)``): the values of the forward's ``mask`` and ``scaled``, computed twice on
    CPU and handed to the delegate twice. The backward reads the forward's nodes
    instead; returns how many casts it replaced."""
    graph = kept.graph
    dtype = mask.kwargs["dtype"]
    shared = 0
    for cast in list(kept.users):
        if cast is mask or not _is(cast, aten._to_copy.default) or cast.args != (kept,):
            continue
        kwargs = dict(cast.kwargs)
        if (
            kwargs.pop("dtype", None) != dtype
            or kwargs.pop("layout", torch.strided) != torch.strided
            or kwargs.pop("device", None) not in (None, torch.device("cpu"))
            or kwargs
        ):
            continue
        for user in list(cast.users):
            if (
                scaled is not mask
                and _is(user, aten.mul.Tensor)
                and user.args[0] is cast
                and type(user.args[1]) is float
                and user.args[1] == scale
            ):
                user.replace_all_uses_with(scaled)
                graph.erase_node(user)
        cast.replace_all_uses_with(mask)
        graph.erase_node(cast)
        shared += 1
    return shared


def _replace_outputs(node: torch.fx.Node, out: torch.fx.Node, kept: torch.fx.Node) -> None:
    """``native_dropout``'s getitems become ``out`` (0) and ``kept`` (1)."""
    for user in list(node.users):
        if not _is(user, operator.getitem):
            raise ValueError(
                f"native_dropout {node.name}: read by {user.name} ({user.target}), not "
                "through its outputs: cannot rewrite it"
            )
        user.replace_all_uses_with(out if user.args[1] == 0 else kept)
        node.graph.erase_node(user)
