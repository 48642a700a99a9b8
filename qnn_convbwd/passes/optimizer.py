"""The optimizer inside a joint program: one call of ``forward`` is one training step.

``attach`` rewrites a joint forward-backward program
(``torch.export.experimental._export_forward_backward``) so that it applies its own
gradients:

* every parameter the program returns a gradient for becomes a **buffer the program
  updates** (a buffer mutation: the runtime keeps it in the method's memory between
  calls), under its own name, fp32; its placeholder carries ``meta.TRAINED`` so the
  plugin treats it as a trainable parameter (a delegate input read at run time);
* the optimizer's state (SGD's momentum buffers, Adam's first and second moments,
  the step count) and the learning rate are buffers of the program too
  (``PREFIX``...), so the program holds everything a step reads;
* the gradients feed the update instead of leaving the program; the program returns
  the loss and nothing else;
* with a ``DynamicLossScale`` the backward is seeded with a scale buffer, the
  gradients are unscaled in fp32, a step with any non-finite gradient is skipped
  (parameters, state and step count unchanged) and the scale backs off or grows as
  ``torch.amp.GradScaler`` does.

The update follows ``torch.optim``'s single-tensor formulas op for op (the order of
every product and sum, the bias corrections computed in float64 from the step count
and cast to float32 where torch casts its Python scalars). Each node it adds carries
``meta.OPTIMIZER`` in ``node.meta["custom"]`` (which survives executorch's
decompositions); the partition rule ``optimizer_on_cpu`` keeps them on CPU in fp32.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch.export.graph_signature import (
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
    TensorArgument,
)

from .. import integration
from ..meta import OPTIMIZER, TRAINED

logger = logging.getLogger(__name__)

aten = torch.ops.aten

# The scalars (learning rate, step count, loss scale, growth tracker) are
# one-element 1-D buffers: executorch's Qualcomm passes turn 0-d tensors into 1-D
# ones, and a dtype conversion of a 0-d buffer then fails its dim-order check at run
# time.
# Names of the buffers ``attach`` adds (a session leaves them out of the module's
# state_dict: they start with ``training.PLUGIN_BUFFER_PREFIX``).
PREFIX = "qnn_convbwd_optim_"
LR_BUFFER = PREFIX + "lr"
STEP_BUFFER = PREFIX + "step"
SCALE_BUFFER = "qnn_convbwd_loss_scale"
GROWTH_BUFFER = "qnn_convbwd_loss_scale_growth_tracker"


class OptimizerError(ValueError):
    """A program or a setting the in-program optimizer cannot take."""


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise OptimizerError(message)


@dataclasses.dataclass(frozen=True)
class SGD:
    """``torch.optim.SGD``'s update, applied inside the program."""

    lr: float
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def __post_init__(self) -> None:
        _check(self.lr >= 0, f"SGD: invalid learning rate {self.lr}")
        _check(self.momentum >= 0, f"SGD: invalid momentum {self.momentum}")
        _check(self.weight_decay >= 0, f"SGD: invalid weight_decay {self.weight_decay}")
        _check(
            not self.nesterov or (self.momentum > 0 and self.dampening == 0),
            "SGD: nesterov momentum requires a momentum and zero dampening",
        )

    def state_keys(self) -> tuple[str, ...]:
        """The per-parameter state torch.optim keeps (the names of its state_dict)."""
        return ("momentum_buffer",) if self.momentum != 0 else ()

    @property
    def counts_steps(self) -> bool:
        return self.momentum != 0

    def torch_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        """The same optimizer in torch, over ``params``."""
        return torch.optim.SGD(
            params,
            lr=self.lr,
            momentum=self.momentum,
            dampening=self.dampening,
            weight_decay=self.weight_decay,
            nesterov=self.nesterov,
        )

    def hyper(self) -> dict[str, Any]:
        """The hyper-parameters baked into the program (all but ``lr``)."""
        return {
            "momentum": self.momentum,
            "dampening": self.dampening,
            "weight_decay": self.weight_decay,
            "nesterov": self.nesterov,
        }


@dataclasses.dataclass(frozen=True)
class Adam:
    """``torch.optim.Adam``'s update (L2 weight decay added to the gradient), applied
    inside the program."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled: ClassVar[bool] = False

    def __post_init__(self) -> None:
        name = type(self).__name__
        _check(self.lr >= 0, f"{name}: invalid learning rate {self.lr}")
        _check(self.eps >= 0, f"{name}: invalid epsilon {self.eps}")
        _check(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            f"{name}: invalid betas {self.betas}",
        )
        _check(self.weight_decay >= 0, f"{name}: invalid weight_decay {self.weight_decay}")
        object.__setattr__(self, "betas", (float(self.betas[0]), float(self.betas[1])))

    def state_keys(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")

    counts_steps: ClassVar[bool] = True

    def torch_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        kind = torch.optim.AdamW if self.decoupled else torch.optim.Adam
        return kind(
            params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay
        )

    def hyper(self) -> dict[str, Any]:
        return {
            "betas": self.betas,
            "eps": self.eps,
            "weight_decay": self.weight_decay,
            "decoupled_weight_decay": self.decoupled,
        }


@dataclasses.dataclass(frozen=True)
class AdamW(Adam):
    """``torch.optim.AdamW``'s update (decoupled weight decay), applied inside the
    program."""

    weight_decay: float = 1e-2
    decoupled: ClassVar[bool] = True


Optimizer = SGD | Adam


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """``torch.amp.GradScaler``'s dynamic loss scale, kept and updated by the program."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        _check(
            self.init_scale > 0 and math.isfinite(self.init_scale),
            f"DynamicLossScale: invalid init_scale {self.init_scale}",
        )
        _check(
            self.growth_factor > 1.0,
            f"DynamicLossScale: growth_factor {self.growth_factor} must be > 1",
        )
        _check(
            0.0 < self.backoff_factor < 1.0,
            f"DynamicLossScale: backoff_factor {self.backoff_factor} must be in (0, 1)",
        )
        _check(
            isinstance(self.growth_interval, int) and self.growth_interval > 0,
            f"DynamicLossScale: growth_interval {self.growth_interval} must be a positive int",
        )


@dataclasses.dataclass(frozen=True)
class ProgramOptimizer:
    """What ``attach`` put into a program: its settings and the names of its buffers.

    ``parameters``: program names of the trained parameters, in the order of the
    module's ``parameters()`` (torch.optim's parameter indices). ``state``: for each
    of them, state key (``exp_avg``, ...) -> buffer name.
    """

    optimizer: Optimizer
    loss_scale: DynamicLossScale | None
    parameters: tuple[str, ...]
    state: tuple[dict[str, str], ...]

    def as_dict(self) -> dict[str, Any]:
        """A JSON-able description (``from_dict`` reads it back): the optimizer's kind,
        learning rate and baked-in hyper-parameters, the loss scale's settings and the
        names of the program's buffers. A program's ``.pte`` plus this is what a session
        (``training.ProgramOptimizerSession``) needs to load it."""
        settings = dataclasses.asdict(self.optimizer)
        if "betas" in settings:
            settings["betas"] = list(settings["betas"])
        return {
            "kind": type(self.optimizer).__name__,
            **settings,
            "loss_scale": None if self.loss_scale is None else dataclasses.asdict(self.loss_scale),
            "parameters": list(self.parameters),
            "state": [dict(names) for names in self.state],
        }

    @classmethod
    def from_dict(cls, description: Mapping[str, Any]) -> ProgramOptimizer:
        """The ``ProgramOptimizer`` that ``as_dict`` described; ``OptimizerError`` names
        what does not fit."""
        kinds = {"SGD": SGD, "Adam": Adam, "AdamW": AdamW}
        try:
            kind = kinds[description["kind"]]
            fields = {f.name for f in dataclasses.fields(kind)}
            settings = {k: v for k, v in description.items() if k in fields}
            if "betas" in settings:
                settings["betas"] = tuple(settings["betas"])
            scale = description.get("loss_scale")
            return cls(
                kind(**settings),
                None if scale is None else DynamicLossScale(**scale),
                tuple(description["parameters"]),
                tuple(dict(names) for names in description["state"]),
            )
        except (KeyError, TypeError) as err:
            raise OptimizerError(
                f"not a description of an in-program optimizer ({type(err).__name__}: {err})"
            ) from None

    @property
    def buffers(self) -> tuple[str, ...]:
        """Every buffer the optimizer added (state, step, lr, loss scale)."""
        names = [LR_BUFFER]
        if self.optimizer.counts_steps:
            names.append(STEP_BUFFER)
        if self.loss_scale is not None:
            names += [SCALE_BUFFER, GROWTH_BUFFER]
        return (*names, *(name for state in self.state for name in state.values()))


class _Builder:
    """Adds ATen nodes (with fake values, tagged ``OPTIMIZER``) before ``anchor``."""

    def __init__(self, graph: torch.fx.Graph, fake_mode, anchor: torch.fx.Node) -> None:
        self.graph = graph
        self.fake_mode = fake_mode
        self.anchor = anchor
        self.role = ""

    def __call__(self, op, *args, **kwargs) -> torch.fx.Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(op, args, kwargs)
        fake = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
        with self.fake_mode:
            node.meta["val"] = op(*fake[0], **fake[1])
        node.meta["custom"] = {**node.meta.get("custom", {}), OPTIMIZER: self.role}
        return node

    def f32(self, node: torch.fx.Node) -> torch.fx.Node:
        return self(aten._to_copy.default, node, dtype=torch.float32)

    def f64(self, node: torch.fx.Node) -> torch.fx.Node:
        return self(aten._to_copy.default, node, dtype=torch.float64)

    def const64(self, value: Any) -> torch.fx.Node:
        """``value`` as a float64 constant (a node stays as it is). A Python scalar
        operand of an edge op becomes a float32 constant, so float64 arithmetic spells
        its constants out."""
        if isinstance(value, torch.fx.Node):
            return value
        return self(aten.full.default, [1], float(value), dtype=torch.float64)


def _float32(value: float) -> float:
    """``value`` rounded to float32, as torch's CPU kernels round a Python scalar."""
    return float(torch.tensor(value, dtype=torch.float32))


def _lerp(b: _Builder, start, end, weight: float):
    """``start.lerp_(end, weight)`` as torch's CPU kernel computes it in float32."""
    w = _float32(weight)
    if abs(w) < 0.5:
        return b(aten.add.Tensor, start, b(aten.mul.Tensor, b(aten.sub.Tensor, end, start), w))
    rest = float(torch.tensor(1.0) - torch.tensor(w, dtype=torch.float32))
    return b(aten.sub.Tensor, end, b(aten.mul.Tensor, b(aten.sub.Tensor, end, start), rest))


@dataclasses.dataclass
class _Step:
    """The program's per-step scalars: the learning rate (float64) and, when the
    optimizer counts steps, the step count before this step (float32)."""

    lr: torch.fx.Node
    step: torch.fx.Node | None


def _sgd(b: _Builder, opt: SGD, p, g, state: dict, scalars: _Step) -> tuple[Any, dict]:
    """One ``torch.optim.SGD`` step of ``p``: (next parameter, next state).

    Each ``a + alpha * b`` and ``a * alpha`` is computed in float64 with ``alpha`` as
    given and rounded to float32 where a tensor is stored, as executorch's SGD
    (``get_sgd_optimizer``) computes them with its portable kernels and a double
    ``alpha``: the program's SGD equals executorch's bit for bit
    (tests/test_optimizer.py), and torch's to its float32 rounding."""

    def axpy(x, y, alpha: Any):  # float32(x + alpha * y), in float64
        scaled = b(aten.mul.Tensor, b.f64(y), b.const64(alpha))
        return b.f32(b(aten.add.Tensor, b.f64(x), scaled))

    d = g
    if opt.weight_decay != 0:
        d = axpy(d, p, opt.weight_decay)
    new_state = {}
    if opt.momentum != 0:
        buf = state["momentum_buffer"]
        later = b.f32(b(aten.mul.Tensor, b.f64(buf), b.const64(opt.momentum)))
        later = axpy(later, d, 1.0 - opt.dampening)
        if opt.dampening != 0:
            # torch starts the buffer as a copy of the first gradient.
            first = b(aten.eq.Scalar, scalars.step, 0.0)
            later = b(aten.where.self, first, d, later)
        new_state["momentum_buffer"] = later
        d = axpy(d, later, opt.momentum) if opt.nesterov else later
    return axpy(p, d, b(aten.neg.default, scalars.lr)), new_state


def _adam(b: _Builder, opt: Adam, p, g, state: dict, scalars: _Step, shared: dict):
    """One ``torch.optim.Adam`` / ``AdamW`` step of ``p``: (next parameter, next state)."""
    beta1, beta2 = opt.betas
    if "step_size" not in shared:
        step = b.f64(b(aten.add.Tensor, scalars.step, 1.0))
        one = b.const64(1.0)
        correction1 = b(aten.sub.Tensor, one, b(aten.pow.Tensor_Tensor, b.const64(beta1), step))
        correction2 = b(aten.sub.Tensor, one, b(aten.pow.Tensor_Tensor, b.const64(beta2), step))
        shared["step_size"] = b.f32(b(aten.div.Tensor, scalars.lr, correction1))
        shared["correction2_sqrt"] = b.f32(b(aten.sqrt.default, correction2))
        if opt.weight_decay != 0 and opt.decoupled:
            decay = b(aten.mul.Tensor, scalars.lr, b.const64(opt.weight_decay))
            shared["decay"] = b.f32(b(aten.sub.Tensor, one, decay))
    if opt.weight_decay != 0:
        if opt.decoupled:
            p = b(aten.mul.Tensor, p, shared["decay"])
        else:
            g = b(aten.add.Tensor, g, b(aten.mul.Tensor, p, opt.weight_decay))
    exp_avg = _lerp(b, state["exp_avg"], g, 1.0 - beta1)
    exp_avg_sq = b(
        aten.add.Tensor,
        b(aten.mul.Tensor, state["exp_avg_sq"], beta2),
        b(aten.mul.Tensor, b(aten.mul.Tensor, g, 1.0 - beta2), g),
    )
    denom = b(aten.div.Tensor, b(aten.sqrt.default, exp_avg_sq), shared["correction2_sqrt"])
    denom = b(aten.add.Tensor, denom, opt.eps)
    update = b(aten.div.Tensor, b(aten.mul.Tensor, exp_avg, shared["step_size"]), denom)
    return b(aten.sub.Tensor, p, update), {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def find_seed(graph: torch.fx.Graph, loss: torch.fx.Node) -> torch.fx.Node:
    """The ``full_like(loss, 1)`` (or ``ones_like``) the joint graph's backward starts
    from, in ATen."""
    candidates = []
    for node in graph.nodes:
        if node.op != "call_function" or not node.args or node.args[0] is not loss:
            continue
        if node.target == aten.full_like.default and node.args[1] == 1:
            candidates.append(node)
        elif node.target == aten.ones_like.default:
            candidates.append(node)
    if len(candidates) != 1:
        raise OptimizerError(
            f"loss scale: expected one backward seed of value 1 on the loss {loss.name}, "
            f"found {[n.name for n in candidates]}"
        )
    return candidates[0]


class _Program:
    """The joint program being rewritten: its graph, signature and new buffers."""

    def __init__(self, program: torch.export.ExportedProgram) -> None:
        self.program = program
        self.graph = program.graph
        self.signature = program.graph_signature
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        self.fake_mode = integration.get("detect_fake_mode")([n.meta["val"] for n in placeholders])
        self.output = self.graph.output_node()
        self.mutations: list[tuple[str, torch.fx.Node]] = []  # (buffer, next value)

    def placeholder(self, name: str) -> torch.fx.Node:
        return next(n for n in self.graph.nodes if n.op == "placeholder" and n.name == name)

    def add_buffer(self, target: str, initial: torch.Tensor) -> torch.fx.Node:
        """A new persistent buffer read by a placeholder (ordered by ``finish``)."""
        first = next(n for n in self.graph.nodes if n.op == "placeholder")
        with self.graph.inserting_before(first):
            node = self.graph.placeholder("b_" + target)
        node.meta["val"] = self.fake_mode.from_tensor(initial, static_shapes=True)
        self.signature.input_specs.append(
            InputSpec(InputKind.BUFFER, TensorArgument(node.name), target, persistent=True)
        )
        self.program.state_dict[target] = initial
        return node

    def finish(self, keep_outputs: list[tuple[OutputSpec, Any]]) -> None:
        """Inputs ordered parameters, buffers, the rest (placeholders likewise); the
        outputs: every buffer mutation, then ``keep_outputs``."""
        rank = {InputKind.PARAMETER: 0, InputKind.BUFFER: 1}
        specs = sorted(self.signature.input_specs, key=lambda s: rank.get(s.kind, 2))
        self.signature.input_specs[:] = specs
        by_name = {n.name: n for n in self.graph.nodes if n.op == "placeholder"}
        anchor = next(n for n in self.graph.nodes if n.op != "placeholder")
        for spec in specs:
            anchor.prepend(by_name[spec.arg.name])
        mutations = [
            (OutputSpec(OutputKind.BUFFER_MUTATION, TensorArgument(value.name), target), value)
            for target, value in self.mutations
        ]
        outputs = mutations + keep_outputs
        self.signature.output_specs[:] = [spec for spec, _ in outputs]
        self.output.args = (tuple(value for _, value in outputs),)
        self.program.graph_module.recompile()


def attach(
    program: torch.export.ExportedProgram,
    optimizer: Optimizer,
    loss_scale: DynamicLossScale | None = None,
) -> tuple[torch.export.ExportedProgram, ProgramOptimizer]:
    """A copy of the joint ``program`` that updates its trainable parameters with
    ``optimizer`` (and keeps ``loss_scale``), returning only its loss."""
    _check(
        isinstance(optimizer, (SGD, Adam)),
        f"optimizer: expected training.SGD, Adam or AdamW, got {type(optimizer).__name__}",
    )
    _check(
        loss_scale is None or isinstance(loss_scale, DynamicLossScale),
        f"loss_scale: expected training.DynamicLossScale, got {type(loss_scale).__name__}",
    )
    program = copy.deepcopy(program)
    rewrite = _Program(program)
    signature = rewrite.signature
    results = list(rewrite.output.args[0])
    outputs = list(zip(signature.output_specs, results))
    gradients = {
        spec.target: value
        for spec, value in outputs
        if spec.kind == OutputKind.GRADIENT_TO_PARAMETER
    }
    losses = [value for spec, value in outputs if spec.kind == OutputKind.LOSS_OUTPUT]
    _check(bool(gradients), "optimizer: the program returns no gradient: nothing to train")
    _check(len(losses) == 1, f"optimizer: expected one loss output, found {len(losses)}")
    for target, value in gradients.items():
        _check(
            isinstance(value, torch.fx.Node),
            f"optimizer: the gradient of {target} is not a tensor of the graph ({value!r})",
        )
    trained = [
        spec
        for spec in signature.input_specs
        if spec.kind == InputKind.PARAMETER and spec.target in gradients
    ]
    for spec in trained:
        dtype = program.state_dict[spec.target].dtype
        _check(
            dtype == torch.float32,
            f"optimizer: parameter {spec.target} is {dtype}; the in-program optimizer keeps "
            "float32 master weights",
        )

    # The trained parameters become buffers the program updates.
    for i, spec in enumerate(signature.input_specs):
        if spec in trained:
            signature.input_specs[i] = InputSpec(
                InputKind.BUFFER, spec.arg, spec.target, persistent=True
            )
            value = program.state_dict.pop(spec.target)
            program.state_dict[spec.target] = value.detach().clone()
            node = rewrite.placeholder(spec.arg.name)
            # A buffer's value does not require grad (the write-back is an in-place copy).
            node.meta["val"] = rewrite.fake_mode.from_tensor(
                program.state_dict[spec.target], static_shapes=True
            )
            node.meta["custom"] = {**node.meta.get("custom", {}), TRAINED: spec.target}

    b = _Builder(rewrite.graph, rewrite.fake_mode, rewrite.output)
    lr = rewrite.add_buffer(LR_BUFFER, torch.tensor([float(optimizer.lr)], dtype=torch.float64))
    rewrite.mutations.append((LR_BUFFER, lr))  # written back unchanged: a mutable buffer
    step = None
    if optimizer.counts_steps:
        step = rewrite.add_buffer(STEP_BUFFER, torch.zeros(1, dtype=torch.float32))
    scalars = _Step(lr, step)

    grads = {spec.target: gradients[spec.target] for spec in trained}
    skipped = None
    if loss_scale is not None:
        skipped, grads = _scale_loss(rewrite, b, loss_scale, losses[0], grads)

    shared: dict = {}
    state_names = []
    for index, spec in enumerate(trained):
        b.role = spec.target
        p = rewrite.placeholder(spec.arg.name)
        names = {key: f"{PREFIX}{index}_{key}" for key in optimizer.state_keys()}
        state = {
            key: rewrite.add_buffer(name, torch.zeros_like(program.state_dict[spec.target]))
            for key, name in names.items()
        }
        if isinstance(optimizer, SGD):
            new_p, new_state = _sgd(b, optimizer, p, grads[spec.target], state, scalars)
        else:
            new_p, new_state = _adam(b, optimizer, p, grads[spec.target], state, scalars, shared)
        if skipped is not None:
            new_p = b(aten.where.self, skipped, p, new_p)
            new_state = {k: b(aten.where.self, skipped, state[k], v) for k, v in new_state.items()}
        rewrite.mutations.append((spec.target, new_p))
        rewrite.mutations += [(names[k], v) for k, v in new_state.items()]
        state_names.append(names)
    if step is not None:
        b.role = STEP_BUFFER
        following = b(aten.add.Tensor, step, 1.0)
        if skipped is not None:
            following = b(aten.where.self, skipped, step, following)
        rewrite.mutations.append((STEP_BUFFER, following))

    kept = [
        (spec, value)
        for spec, value in outputs
        if spec.kind != OutputKind.GRADIENT_TO_PARAMETER and spec.kind != OutputKind.BUFFER_MUTATION
    ]
    rewrite.mutations[:0] = [
        (spec.target, value) for spec, value in outputs if spec.kind == OutputKind.BUFFER_MUTATION
    ]
    rewrite.finish(kept)
    result = ProgramOptimizer(
        optimizer, loss_scale, tuple(s.target for s in trained), tuple(state_names)
    )
    logger.info(
        "optimizer: %s inside the program, %d parameters, %d state buffers%s",
        type(optimizer).__name__,
        len(trained),
        sum(len(s) for s in state_names),
        ", dynamic loss scale" if loss_scale is not None else "",
    )
    return program, result


def _scale_loss(
    rewrite: _Program,
    b: _Builder,
    loss_scale: DynamicLossScale,
    loss: torch.fx.Node,
    grads: dict[str, torch.fx.Node],
) -> tuple[torch.fx.Node, dict[str, torch.fx.Node]]:
    """Seed the backward with the scale buffer; unscale the gradients; update the scale
    as ``GradScaler.update`` does. Returns (whether this step is skipped, gradients)."""
    scale = rewrite.add_buffer(
        SCALE_BUFFER, torch.tensor([float(loss_scale.init_scale)], dtype=torch.float32)
    )
    tracker = rewrite.add_buffer(GROWTH_BUFFER, torch.zeros(1, dtype=torch.int32))
    seed = find_seed(rewrite.graph, loss)
    users = list(seed.users)
    order = {n: i for i, n in enumerate(rewrite.graph.nodes)}
    seeded = _Builder(
        rewrite.graph,
        rewrite.fake_mode,
        min(users, key=order.__getitem__) if users else rewrite.output,
    )
    seeded.role = b.role = SCALE_BUFFER
    # The seed times the scale, on CPU: the scale reaches the delegate as an input. A
    # 0-d seed (a reduced loss) is the scale itself, read from the buffer alone: not
    # from the loss, so the CPU ops on the seed need nothing from the forward, and the
    # forward and the backward stay one delegate.
    scaled_seed = seeded(aten.sum.default, scale)
    if tuple(seed.meta["val"].shape) != ():
        scaled_seed = seeded(aten.mul.Tensor, seed, scaled_seed)
    for user in users:
        user.replace_input_with(seed, scaled_seed)
    if not seed.users:
        rewrite.graph.erase_node(seed)

    # GradScaler.unscale_: inv = 1 / scale in float64, cast to float32; a gradient is
    # non-finite before it is unscaled.
    inverse = b.f32(b(aten.reciprocal.default, b.f64(scale)))
    probe = None
    unscaled = {}
    for target, g in grads.items():
        zero = b(aten.sum.default, b(aten.mul.Tensor, g, 0.0))  # NaN iff g has inf or NaN
        probe = zero if probe is None else b(aten.add.Tensor, probe, zero)
        unscaled[target] = b(aten.mul.Tensor, g, inverse)
    skipped = b(aten.isnan.default, probe)

    # GradScaler.update: back off on a skipped step; grow after growth_interval clean
    # steps in a row, unless the grown scale is not finite.
    successful = b(aten.add.Tensor, tracker, 1)
    grow = b(aten.eq.Scalar, successful, loss_scale.growth_interval)
    grown = b(aten.mul.Tensor, scale, loss_scale.growth_factor)
    grown = b(aten.where.self, b(aten.isinf.default, grown), scale, grown)
    zero_count = b(aten.mul.Tensor, tracker, 0)
    clean_scale = b(aten.where.self, grow, grown, scale)
    clean_tracker = b(aten.where.self, grow, zero_count, successful)
    backed_off = b(aten.mul.Tensor, scale, loss_scale.backoff_factor)
    rewrite.mutations.append((SCALE_BUFFER, b(aten.where.self, skipped, backed_off, clean_scale)))
    rewrite.mutations.append(
        (GROWTH_BUFFER, b(aten.where.self, skipped, zero_count, clean_tracker))
    )
    return skipped, unscaled
