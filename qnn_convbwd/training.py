"""Train a lowered joint program with ExecuTorch's runtime and SGD optimizer.

``to_executorch()`` emits the ``__et_training_*`` methods of a joint program:
where its outputs' gradients and parameters start, and the parameters' names.
``TrainingSession`` loads the program once, runs its ``forward`` method and
hands the parameters and gradients to executorch's SGD optimizer, which
updates the parameters in place. A program lowered with this plugin keeps
every trainable parameter a top-level tensor that the QNN delegate reads at
run time (``qnn_convbwd.signature``), so the update reaches the next step's
delegate. Buffers the program updates (batch norm running statistics in
``train()``) live in the loaded method and are read and written by name;
``state_dict`` / ``load_state_dict`` use the eager module's names.

``lower_for_training`` goes from a module that returns its loss to a
``TrainingProgram`` whose ``session()`` knows how to name its state.

A session keeps the program's bytes (and its ``.ptd`` data file) alive for as
long as the loaded program runs, and releases the program first (``close``).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import tempfile
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from . import integration, options, progress, quantized
from .passes import filter_storage
from .passes import optimizer as optimizer_pass

# The in-program optimizer's settings (``lower_for_training(optimizer=..., loss_scale=...)``).
from .passes.optimizer import SGD as SGD
from .passes.optimizer import Adam as Adam
from .passes.optimizer import AdamW as AdamW
from .passes.optimizer import DynamicLossScale as DynamicLossScale
from .passes.optimizer import OptimizerError as OptimizerError
from .passes.optimizer import ProgramOptimizer as ProgramOptimizer

logger = logging.getLogger(__name__)


class WithLoss(torch.nn.Module):
    """``net`` followed by ``loss(net(x), target)``: the module a joint graph is exported
    from (``export_joint``)."""

    def __init__(self, net: torch.nn.Module, loss) -> None:
        super().__init__()
        self.net = net
        self.loss = loss

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss(self.net(x), target)


def export_joint(module: torch.nn.Module, inputs: tuple) -> torch.export.ExportedProgram:
    """``torch.export`` + ``_export_forward_backward``: the joint training graph.

    ``module(*inputs)`` returns the loss (first output); parameters with
    ``requires_grad`` are the trainable ones.
    """
    from torch.export.experimental import _export_forward_backward

    from .passes.train_mode import cumulative_average_batch_norm

    # Batch norms with momentum=None (a cumulative average) do not export as they are.
    with cumulative_average_batch_norm(module):
        exported = torch.export.export(module, inputs, strict=True)
    return _export_forward_backward(exported)


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """How a program's tensors are named in the eager module's ``state_dict``.

    ``prefix``: what the program's names carry in front of the eager module's
    (``"net."`` for a ``WithLoss``). ``constants``: eager name -> value of every
    parameter and persistent buffer baked into the program (frozen parameters,
    buffers the program does not update). ``transient``: program names of the
    updated buffers that are not persistent (not part of a ``state_dict``).
    """

    prefix: str = ""
    constants: Mapping[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    transient: frozenset[str] = frozenset()

    def eager_name(self, fqn: str) -> str:
        return fqn[len(self.prefix) :] if self.prefix and fqn.startswith(self.prefix) else fqn

    @classmethod
    def from_program(
        cls, joint: torch.export.ExportedProgram, prefix: str | None = None
    ) -> StateLayout:
        """The layout of a program lowered from ``joint`` (``export_joint``'s result).

        ``prefix`` defaults to the first name component every parameter and buffer shares.
        """
        from torch.export.graph_signature import InputKind

        signature = joint.graph_signature
        specs = [
            s for s in signature.input_specs if s.kind in (InputKind.PARAMETER, InputKind.BUFFER)
        ]
        if prefix is None:
            prefix = shared_prefix([s.target for s in specs])
        trainable = set(signature.parameters) & {
            s.target for s in signature.output_specs if s.kind.name == "GRADIENT_TO_PARAMETER"
        }
        mutated = set(signature.buffers_to_mutate.values())
        layout = cls(prefix)
        values = {**joint.state_dict, **joint.constants}
        constants = {
            layout.eager_name(s.target): values[s.target].detach().clone()
            for s in specs
            if s.target not in trainable
            and s.target not in mutated
            and (s.kind == InputKind.PARAMETER or s.persistent)
        }
        transient = (
            frozenset(s.target for s in specs if s.kind == InputKind.BUFFER and not s.persistent)
            & mutated
        )
        return cls(prefix, constants, transient)


def shared_prefix(names: Sequence[str]) -> str:
    """``"net."`` when every name starts with ``net.`` (a loss wrapper's attribute), else
    ``""``."""
    heads = {name.split(".", 1)[0] for name in names if "." in name}
    if len(heads) == 1 and all("." in name for name in names):
        return heads.pop() + "."
    return ""


# Buffers the plugin's passes add to a program (``passes.dropout.STEP_BUFFER``) start
# with this: they are program state, not the module's, so no state_dict holds them.
PLUGIN_BUFFER_PREFIX = "qnn_convbwd_"


class StateDictError(ValueError):
    """A state dict that does not fit the program (names, shapes or baked-in values)."""


class _LoadedProgram:
    """A program loaded with executorch's pybindings, its methods loaded once each.

    ``run_method`` mirrors ``ExecuTorchModule.run_method``, so executorch's
    ``TrainingModule`` can drive the same loaded methods (and see the same state).
    """

    def __init__(self, pte: bytes, data_path: str | None, etdump: bool = False) -> None:
        load = integration.get("_load_program_from_buffer")
        options: dict[str, Any] = {"data_path": data_path} if data_path else {}
        if etdump:  # as executorch.runtime's Runtime.load_program(enable_etdump=True) loads it
            options["enable_etdump"] = True
        self.program = load(pte, **options)
        self._methods: dict = {}

    def method_names(self) -> list[str]:
        return [self.program.get_method_name(i) for i in range(self.program.num_methods())]

    def method(self, name: str):
        if name not in self._methods:
            self._methods[name] = self.program.load_method(name)
        return self._methods[name]

    def run_method(self, name: str, inputs: Sequence = (), clone_outputs: bool = True) -> list:
        return self.method(name).call(list(inputs), clone_outputs=clone_outputs)


def _mutable_buffer_names(pte: bytes) -> list[str]:
    """Names of the tensors of ``forward`` stored in the program's mutable data segment
    (emitted with ``emit_mutable_buffer_names=True``): the buffers the program updates,
    each once, in the order the program lists them."""
    return list(program_buffers(pte))


# executorch's serialized scalar types (``exir.schema.ScalarType``) of the tensors a
# training program keeps, by name.
_SCALAR_TYPES = {
    "BYTE": torch.uint8,
    "CHAR": torch.int8,
    "SHORT": torch.int16,
    "INT": torch.int32,
    "LONG": torch.int64,
    "HALF": torch.float16,
    "FLOAT": torch.float32,
    "DOUBLE": torch.float64,
    "BOOL": torch.bool,
    "BFLOAT16": torch.bfloat16,
}


@dataclasses.dataclass(frozen=True)
class BufferSpec:
    """A tensor a program keeps from call to call: its dtype and shape."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def program_buffers(pte: bytes) -> dict[str, BufferSpec]:
    """Every tensor of ``forward`` in the program's mutable data segment (the buffers it
    updates: trainable parameters of a program with an in-program optimizer, running
    statistics, optimizer state, the plugin's counters), by name, read from the ``.pte``
    bytes alone (nothing is loaded)."""
    result = integration.get("deserialize_pte_binary")(pte)
    program = getattr(result, "program", result)
    (plan,) = [p for p in program.execution_plan if p.name == "forward"]
    found: dict[str, BufferSpec] = {}
    for value in plan.values:
        info = getattr(value.val, "extra_tensor_info", None)
        if info is None or not info.fully_qualified_name or info.location.name != "SEGMENT":
            continue
        if info.fully_qualified_name in found:
            continue
        kind = getattr(value.val.scalar_type, "name", str(value.val.scalar_type))
        if kind not in _SCALAR_TYPES:
            raise ValueError(f"{info.fully_qualified_name}: unsupported scalar type {kind}")
        found[info.fully_qualified_name] = BufferSpec(
            _SCALAR_TYPES[kind], tuple(int(d) for d in value.val.sizes)
        )
    return found


def stored_layouts(pte: bytes) -> dict[str, tuple[int, ...]]:
    """The trainable parameters the program stores in another layout than torch's, each
    with the permutation of torch's tensor it stores (``passes.filter_storage``); only
    the program is loaded, none of its delegates."""
    loaded = _LoadedProgram(bytes(pte), None)
    if filter_storage.METHOD not in loaded.method_names():
        return {}
    (text,) = loaded.run_method(filter_storage.METHOD)
    return filter_storage.decode(text)


class _State:
    """``state_dict`` / ``load_state_dict`` of a session, over its ``_targets()``: eager
    name -> (kind, the tensor the state lives in)."""

    layout: StateLayout

    def _load(self, pte: bytes, ptd: bytes | None, etdump: bool = False) -> bytes:
        """Load the program from ``pte`` (and its tensor data file ``ptd``) into
        ``self._loaded``; returns the bytes kept.

        The runtime reads these buffers while the program runs: they are kept alive
        (``ptd`` in a file), and ``close`` lets the program go first."""
        self.pte, self.ptd = bytes(pte), None if ptd is None else bytes(ptd)
        self._data_file = None
        if self.ptd is not None:
            self._data_file = tempfile.NamedTemporaryFile(suffix=".ptd")
            self._data_file.write(self.ptd)
            self._data_file.flush()
        self._loaded = _LoadedProgram(self.pte, self._data_file and self._data_file.name, etdump)
        self._stored: dict[str, tuple[int, ...]] = {}
        if filter_storage.METHOD in self._loaded.method_names():
            (text,) = self._loaded.run_method(filter_storage.METHOD)
            self._stored = filter_storage.decode(text)
        return self.pte

    def _torch_layout(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The program's tensor of parameter ``name`` (or of its optimizer state) seen in
        torch's layout: a view of what the program stores (``passes.filter_storage``)."""
        return filter_storage.torch_view(tensor, self._stored.get(name))

    def _targets(self) -> dict[str, tuple[str, torch.Tensor]]:
        raise NotImplementedError

    def _program_targets(self) -> dict[str, torch.Tensor]:
        """Program name -> the loaded method's own tensor, for everything the program
        carries from call to call."""
        raise NotImplementedError

    def _checked_inputs(self, inputs: Sequence[torch.Tensor]) -> list:
        """``inputs`` as a list, after checking their count and shapes against the
        program's ``forward`` (executorch 1.5.1's runtime crashes the process on a tensor
        of another shape than a static input's)."""
        inputs = list(inputs)
        meta = self._forward.method_meta()
        if len(inputs) != meta.num_inputs():
            raise ValueError(f"{len(inputs)} inputs given, the program takes {meta.num_inputs()}")
        for index, value in enumerate(inputs):
            expected = tuple(meta.input_tensor_meta(index).sizes())
            if isinstance(value, torch.Tensor) and tuple(value.shape) != expected:
                raise ValueError(
                    f"input {index}: shape {tuple(value.shape)}, the program takes {expected} "
                    "(its shapes, the batch size included, are fixed when it is lowered)"
                )
        return inputs

    def program_state(self) -> dict[str, torch.Tensor]:
        """Copies of everything the program carries from step to step, by program name:
        the trainable parameters and every buffer it updates, the plugin's own ones (the
        dropout step counter; an in-program optimizer's state, step count and learning
        rate) included. ``load_program_state`` puts it back; a program emitted from it
        (``TrainingProgram.emit``) starts where this session is."""
        return {name: t.detach().clone() for name, t in self._program_targets().items()}

    def load_program_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Set the parameters and updated buffers from ``program_state()``'s names; every
        name of this program must be there with its shape and dtype, and nothing is
        written otherwise."""
        targets = self._program_targets()
        missing = sorted(set(targets) - set(state))
        unexpected = sorted(set(state) - set(targets))
        shapes = sorted(
            n
            for n in set(targets) & set(state)
            if tuple(state[n].shape) != tuple(targets[n].shape)
            or state[n].dtype != targets[n].dtype
        )
        if missing or unexpected or shapes:
            raise StateDictError(
                f"program state does not fit the program: missing {missing}, unexpected "
                f"{unexpected}, another shape or dtype {shapes}"
            )
        with torch.no_grad():
            for name, tensor in targets.items():
                tensor.copy_(state[name])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and persistent buffer under the eager module's names (copies):
        trainable parameters and updated buffers from the runtime, the rest as baked
        into the program (``layout.constants``)."""
        return {
            name: t.detach().clone(memory_format=torch.contiguous_format)
            for name, (_, t) in self._targets().items()
        }

    def load_state_dict(self, state: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Set the trainable parameters and updated buffers in the runtime (training goes
        on from there). Values of constants must equal those baked into the program.
        Nothing is written unless every name, shape and constant fits."""
        targets = self._targets()
        problems = []
        if strict:
            missing = sorted(set(targets) - set(state))
            unexpected = sorted(set(state) - set(targets))
            if missing:
                problems.append(f"missing: {missing}")
            if unexpected:
                problems.append(f"unexpected (not in the program): {unexpected}")
        shapes = [
            f"{name}: {tuple(value.shape)} in the state, {tuple(targets[name][1].shape)} in the "
            "program"
            for name, value in state.items()
            if name in targets and tuple(value.shape) != tuple(targets[name][1].shape)
        ]
        if shapes:
            problems.append("shape mismatch: " + "; ".join(shapes))
        if problems:
            raise StateDictError("state dict does not fit the program: " + "; ".join(problems))
        changed = sorted(
            name
            for name, value in state.items()
            if name in targets
            and targets[name][0] == "constant"
            and not torch.equal(value.detach().to(targets[name][1].dtype), targets[name][1])
        )
        if changed:
            raise StateDictError(
                f"these values are baked into the program as constants and differ: {changed}; "
                "they cannot change without lowering the program again"
            )
        with torch.no_grad():
            for name, value in state.items():
                if name in targets and targets[name][0] != "constant":
                    targets[name][1].copy_(value.detach())


class TrainingSession(_State):
    """A lowered joint program loaded by executorch's runtime, trained with its SGD.

    Each ``step`` runs the program's ``forward`` method (loss, gradients, and the
    parameters it read), then executorch's SGD optimizer updates the runtime's own
    parameter tensors in place; buffers the program updates (batch norm running
    statistics) stay in the method between steps and are read and written by name.
    """

    def __init__(
        self,
        pte: bytes,
        lr: float,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        dampening: float = 0.0,
        nesterov: bool = False,
        ptd: bytes | None = None,
        *,
        layout: StateLayout | None = None,
        etdump: bool = False,
    ):
        """SGD options as ``torch.optim.SGD``'s. ``ptd``: the tensor data file of a program
        exported with external weights (``ExecutorchBackendConfig(external_mutable_weights=
        True, ...)``). ``layout``: how ``state_dict`` names the tensors (``lower_for_training``
        passes it); without it, names lose the prefix they all share and the state holds
        only what the program updates. ``etdump``: the runtime records every instruction's
        time (executorch's ETDump) for ``write_etdump``."""
        from executorch.extension.training import TrainingModule

        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("nesterov momentum requires a momentum and zero dampening")
        pte = self._load(pte, ptd, etdump)
        self.etdump = etdump
        # executorch's TrainingModule over the same loaded methods.
        self.module = TrainingModule(self._loaded)
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.dampening, self.nesterov = dampening, nesterov

        self._forward = self._loaded.method("forward")
        self._gradients_at = self._loaded.run_method("__et_training_gradients_index_forward")[0]
        self._parameters_at = self._loaded.run_method("__et_training_parameters_index_forward")[0]
        self._fqns = list(self._loaded.run_method("__et_training_fqn_forward"))
        # Before the first execution the method's outputs already hold the parameter
        # tensors it reads (the same memory every step writes and the optimizer updates).
        outputs = self._forward.get_outputs(clone_outputs=False)
        self._parameters = dict(zip(self._fqns, outputs[self._parameters_at :]))
        self._buffer_names = [n for n in _mutable_buffer_names(pte) if n not in self._parameters]
        if layout is None:
            # The plugin's own buffers (the dropout step counter) carry no module prefix.
            own = [n for n in self._buffer_names if not n.startswith(PLUGIN_BUFFER_PREFIX)]
            layout = StateLayout(shared_prefix([*self._fqns, *own]))
        self.layout = layout
        self._gradients: dict[str, torch.Tensor] | None = None
        self._optimizer = None

    def close(self) -> None:
        """Release the loaded program, then the bytes it was loaded from (in that order)."""
        for name in ("_optimizer", "_gradients", "_parameters", "_forward", "module", "_loaded"):
            self.__dict__.pop(name, None)
        data_file = self.__dict__.pop("_data_file", None)
        if data_file is not None:
            data_file.close()

    def __del__(self) -> None:
        self.close()

    def forward_backward(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """User outputs (the loss first); gradients in ``gradients()``."""
        outputs = self._forward.call(self._checked_inputs(inputs), clone_outputs=False)
        user = [
            o.clone() if isinstance(o, torch.Tensor) else o for o in outputs[: self._gradients_at]
        ]
        self._gradients = dict(zip(self._fqns, outputs[self._gradients_at : self._parameters_at]))
        return user

    def gradients(self) -> dict[str, torch.Tensor]:
        """The last ``forward_backward``'s gradients (copies)."""
        if self._gradients is None:
            raise RuntimeError("no gradients before the first forward_backward")
        return {
            name: self._torch_layout(name, g).clone(memory_format=torch.contiguous_format)
            for name, g in self._gradients.items()
        }

    def parameters(self) -> dict[str, torch.Tensor]:
        """The runtime's own trainable parameter tensors, by program name, in torch's
        layout (views of what the program stores; the optimizer updates these in place,
        and writing into them changes the next step's)."""
        return {name: self._torch_layout(name, t) for name, t in self._parameters.items()}

    def buffers(self) -> dict[str, torch.Tensor]:
        """Current values (copies) of the buffers the program updates, by program name."""
        return {name: self._forward.get_attribute(name).clone() for name in self._buffer_names}

    def step(self, inputs: Sequence[torch.Tensor]) -> float:
        """One forward_backward and one SGD step; returns the loss."""
        outputs = self.forward_backward(inputs)
        self.optimizer_step()
        return float(outputs[0])

    def optimizer_step(self) -> None:
        """Executorch's SGD update of the runtime's parameters in place, from the last
        ``forward_backward``'s gradients (``step`` is the two)."""
        if self._gradients is None:
            raise RuntimeError("no gradients before the first forward_backward")
        if self._optimizer is None:
            from executorch.extension.training import get_sgd_optimizer

            self._optimizer = get_sgd_optimizer(
                self._parameters,
                self.lr,
                self.momentum,
                self.dampening,
                self.weight_decay,
                self.nesterov,
            )
        self._optimizer.step(self._gradients)

    def write_etdump(self, etdump_path: str, debug_path: str) -> None:
        """Write the ETDump of every method run so far (a session made with ``etdump=True``)
        to ``etdump_path``, for ``executorch.devtools.Inspector``."""
        if not self.etdump:
            raise RuntimeError("this session records no ETDump: make it with etdump=True")
        self._loaded.program.write_etdump_result_to_file(str(etdump_path), str(debug_path))

    def _program_targets(self) -> dict[str, torch.Tensor]:
        targets = dict(self._parameters)
        targets.update({n: self._forward.get_attribute(n) for n in self._buffer_names})
        return targets

    def _targets(self) -> dict[str, tuple[str, torch.Tensor]]:
        """Eager name -> (kind, the tensor the state lives in)."""
        eager = self.layout.eager_name
        targets = {eager(n): ("parameter", t) for n, t in self.parameters().items()}
        for name in self._buffer_names:
            # The plugin's own buffers (the dropout step counter) are not the module's.
            if name not in self.layout.transient and not name.startswith(PLUGIN_BUFFER_PREFIX):
                targets[eager(name)] = ("buffer", self._forward.get_attribute(name))
        for name, value in self.layout.constants.items():
            targets[name] = ("constant", value)
        return targets


class ProgramOptimizerSession(_State):
    """A program that applies its own optimizer (``lower_for_training(...,
    optimizer=...)``), loaded by executorch's runtime: each ``step`` is one call of its
    ``forward`` method, which runs the forward, the backward and the update and returns
    the loss. Parameters, optimizer state, learning rate and loss scale are buffers of
    the loaded method, read and written by name."""

    def __init__(
        self,
        pte: bytes,
        optimizer: optimizer_pass.ProgramOptimizer,
        ptd: bytes | None = None,
        *,
        layout: StateLayout | None = None,
    ) -> None:
        pte = self._load(pte, ptd)
        self._forward = self._loaded.method("forward")
        self.optimizer = optimizer
        names = _mutable_buffer_names(pte)
        missing = sorted((set(optimizer.parameters) | set(optimizer.buffers)) - set(names))
        if missing:
            self.close()
            raise optimizer_pass.OptimizerError(
                f"the program holds no buffers named {missing}: it was not lowered with "
                "this optimizer (or without emit_mutable_buffer_names)"
            )
        trained = set(optimizer.parameters)
        self._buffer_names = [n for n in names if n not in trained]
        if layout is None:
            # The plugin's own buffers (optimizer state, counters) carry no module prefix.
            own = [n for n in names if not n.startswith(PLUGIN_BUFFER_PREFIX)]
            layout = StateLayout(shared_prefix(own))
        self.layout = layout

    def close(self) -> None:
        """Release the loaded program, then the bytes it was loaded from (in that order)."""
        for name in ("_forward", "_loaded"):
            self.__dict__.pop(name, None)
        data_file = self.__dict__.pop("_data_file", None)
        if data_file is not None:
            data_file.close()

    def __del__(self) -> None:
        self.close()

    def _buffer(self, name: str) -> torch.Tensor:
        """The loaded method's own tensor of a buffer (writing into it changes the next
        step)."""
        return self._forward.get_attribute(name)

    def step(self, inputs: Sequence[torch.Tensor]) -> float:
        """One training step (one call of the program's ``forward``); returns the loss."""
        outputs = self._forward.call(self._checked_inputs(inputs), clone_outputs=False)
        return float(outputs[0])

    @property
    def lr(self) -> float:
        """The learning rate the next step uses (a buffer of the program)."""
        return float(self._buffer(optimizer_pass.LR_BUFFER))

    @lr.setter
    def lr(self, value: float) -> None:
        if not value >= 0:
            raise ValueError(f"invalid learning rate {value}")
        self._buffer(optimizer_pass.LR_BUFFER).fill_(float(value))

    @property
    def loss_scale(self) -> float | None:
        """The dynamic loss scale the next step seeds its backward with (None without
        one)."""
        if self.optimizer.loss_scale is None:
            return None
        return float(self._buffer(optimizer_pass.SCALE_BUFFER))

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        """Set the scale, as ``GradScaler.update(new_scale)`` does."""
        if self.optimizer.loss_scale is None:
            raise ValueError("this program keeps no loss scale (lowered without loss_scale=)")
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"invalid loss scale {value}")
        self._buffer(optimizer_pass.SCALE_BUFFER).fill_(float(value))

    def scaler_state_dict(self) -> dict[str, Any]:
        """The loss scale's state in ``torch.amp.GradScaler.state_dict()``'s format."""
        settings = self.optimizer.loss_scale
        if settings is None:
            raise ValueError("this program keeps no loss scale (lowered without loss_scale=)")
        return {
            "scale": self.loss_scale,
            "growth_factor": settings.growth_factor,
            "backoff_factor": settings.backoff_factor,
            "growth_interval": settings.growth_interval,
            "_growth_tracker": int(self._buffer(optimizer_pass.GROWTH_BUFFER)),
        }

    def load_scaler_state_dict(self, state: Mapping[str, Any]) -> None:
        """Set the loss scale and its growth tracker from ``scaler_state_dict()`` (or a
        ``GradScaler``'s); its factors and interval are baked into the program and must
        match."""
        current = self.scaler_state_dict()
        differ = [
            f"{key}={state.get(key)!r}, the program has {current[key]!r}"
            for key in ("growth_factor", "backoff_factor", "growth_interval")
            if state.get(key) != current[key]
        ]
        if differ:
            raise StateDictError("loss scale state does not fit the program: " + "; ".join(differ))
        tracker = int(state["_growth_tracker"])
        if not 0 <= tracker < current["growth_interval"]:
            raise StateDictError(f"loss scale state: invalid _growth_tracker {tracker}")
        self.loss_scale = float(state["scale"])
        self._buffer(optimizer_pass.GROWTH_BUFFER).fill_(tracker)

    def parameters(self) -> dict[str, torch.Tensor]:
        """The runtime's own trainable parameter tensors, by program name, in torch's
        layout (views of what the program stores)."""
        return {
            name: self._torch_layout(name, self._buffer(name)) for name in self.optimizer.parameters
        }

    def _state_buffer(self, index: int, key: str) -> torch.Tensor:
        """Optimizer state ``key`` of the ``index``-th trained parameter, in torch's layout
        (a view of the program's buffer)."""
        name = self.optimizer.parameters[index]
        return self._torch_layout(name, self._buffer(self.optimizer.state[index][key]))

    def buffers(self) -> dict[str, torch.Tensor]:
        """Current values (copies) of the module's buffers the program updates (batch
        norm running statistics), by program name."""
        return {
            name: self._buffer(name).clone()
            for name in self._buffer_names
            if not name.startswith(PLUGIN_BUFFER_PREFIX)
        }

    def _program_targets(self) -> dict[str, torch.Tensor]:
        # As the program stores them (a trained convolution weight as HWIO).
        targets = {name: self._buffer(name) for name in self.optimizer.parameters}
        targets.update({n: self._buffer(n) for n in self._buffer_names})
        return targets

    def _targets(self) -> dict[str, tuple[str, torch.Tensor]]:
        eager = self.layout.eager_name
        targets = {eager(n): ("parameter", t) for n, t in self.parameters().items()}
        for name in self._buffer_names:
            if name not in self.layout.transient and not name.startswith(PLUGIN_BUFFER_PREFIX):
                targets[eager(name)] = ("buffer", self._buffer(name))
        for name, value in self.layout.constants.items():
            targets[name] = ("constant", value)
        return targets

    def _steps(self) -> float:
        if not self.optimizer.optimizer.counts_steps:
            return 0.0
        return float(self._buffer(optimizer_pass.STEP_BUFFER))

    def _torch_optimizer(self) -> torch.optim.Optimizer:
        params = [p.detach().clone() for p in self.parameters().values()]
        optimizer = self.optimizer.optimizer.torch_optimizer(params)
        optimizer.param_groups[0]["lr"] = self.lr
        return optimizer

    def optimizer_state_dict(self) -> dict[str, Any]:
        """The optimizer's state in ``torch.optim``'s format: ``state`` keyed by the
        parameter's index (the order of the module's trainable parameters),
        ``param_groups`` as the same torch optimizer gives them."""
        groups = self._torch_optimizer().state_dict()["param_groups"]
        steps = self._steps()
        state: dict[int, dict[str, torch.Tensor]] = {}
        if steps > 0 and self.optimizer.optimizer.state_keys():
            for index, names in enumerate(self.optimizer.state):
                entry = {}
                if isinstance(self.optimizer.optimizer, optimizer_pass.Adam):
                    entry["step"] = torch.tensor(steps, dtype=torch.float32)
                entry.update(
                    {
                        key: self._state_buffer(index, key).clone(
                            memory_format=torch.contiguous_format
                        )
                        for key in names
                    }
                )
                state[index] = entry
        return {"state": state, "param_groups": groups}

    def load_optimizer_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Set the learning rate and the optimizer's state from ``state_dict`` (torch.optim's
        format, as ``optimizer_state_dict`` gives it or a torch optimizer of the same kind
        and hyper-parameters). Hyper-parameters baked into the program must match.
        Nothing is written unless all of it fits."""
        groups = state_dict.get("param_groups")
        count = len(self.optimizer.parameters)
        if not isinstance(groups, (list, tuple)) or len(groups) != 1:
            raise StateDictError("optimizer state: expected exactly one param group")
        group = groups[0]
        reference = self._torch_optimizer().state_dict()["param_groups"][0]
        problems = []
        if len(group.get("params", ())) != count:
            problems.append(
                f"{len(group.get('params', ()))} parameters, the program trains {count}"
            )
        for key, value in reference.items():
            if key in ("lr", "params", "initial_lr"):
                continue
            theirs = group.get(key, value)
            if (tuple(theirs) if isinstance(theirs, list) else theirs) != value:
                problems.append(f"{key}={theirs!r}, the program has {value!r}")
        entries = state_dict.get("state", {})
        entries = {int(k): v for k, v in entries.items()}
        keys = self.optimizer.optimizer.state_keys()
        if entries and set(entries) != set(range(count)):
            problems.append(f"state for parameters {sorted(entries)}, expected 0..{count - 1}")
        steps = set()
        writes: list[tuple[torch.Tensor, torch.Tensor]] = []
        for index in range(len(self.optimizer.state)):
            entry = entries.get(index)
            if entry is None:
                continue
            if "step" in entry:
                steps.add(float(entry["step"]))
            for key in keys:
                value = entry.get(key)
                target = self._state_buffer(index, key)
                if not isinstance(value, torch.Tensor) or value.shape != target.shape:
                    shape = None if not isinstance(value, torch.Tensor) else tuple(value.shape)
                    problems.append(
                        f"{index}.{key}: {shape} in the state, {tuple(target.shape)} in the program"
                    )
                    continue
                writes.append((target, value))
        if len(steps) > 1:
            problems.append(f"parameters at different step counts {sorted(steps)}")
        if problems:
            raise StateDictError("optimizer state does not fit the program: " + "; ".join(problems))
        if not isinstance(group.get("lr"), (int, float)) or group["lr"] < 0:
            raise StateDictError(f"optimizer state: invalid lr {group.get('lr')!r}")
        with torch.no_grad():
            if not entries:
                for names in self.optimizer.state:
                    for name in names.values():
                        self._buffer(name).zero_()
            for target, value in writes:
                target.copy_(value.detach())
            if self.optimizer.optimizer.counts_steps:
                # SGD keeps no step in its state: any step past the first will do.
                count_steps = steps.pop() if steps else (1.0 if entries else 0.0)
                self._buffer(optimizer_pass.STEP_BUFFER).fill_(count_steps)
        self.lr = float(group["lr"])


@dataclasses.dataclass
class StepRecord:
    loss: float  # the program's loss (before its update)
    reference_loss: float  # torch eager fp32, same step
    seconds: float  # wall time of the program's forward_backward + step


@dataclasses.dataclass
class TrainingRun:
    steps: list[StepRecord]
    # fqn -> (program update, torch update): theta_N - theta_0 of each trainable tensor
    updates: dict[str, tuple[torch.Tensor, torch.Tensor]]

    def update_cosine(self) -> float:
        """Cosine of the whole update vector (all trainable tensors) against torch's."""
        ours = torch.cat([u.flatten() for u, _ in self.updates.values()])
        theirs = torch.cat([r.flatten() for _, r in self.updates.values()])
        return float(torch.nn.functional.cosine_similarity(ours, theirs, dim=0))

    def update_norm_ratio(self) -> float:
        ours = torch.cat([u.flatten() for u, _ in self.updates.values()])
        theirs = torch.cat([r.flatten() for _, r in self.updates.values()])
        return float(ours.norm() / theirs.norm())

    def worst_loss_gap(self) -> float:
        """max over steps of |loss - torch loss| / max(1, |torch loss|)."""
        return max(
            abs(s.loss - s.reference_loss) / max(1.0, abs(s.reference_loss)) for s in self.steps
        )


@progress.long_call("training on the HTP simulator")
def train_side_by_side(
    pte: bytes,
    model: torch.nn.Module,
    inputs: Sequence[torch.Tensor],
    steps: int,
    lr: float,
    on_step=None,
    ptd: bytes | None = None,
) -> TrainingRun:
    """``steps`` SGD steps of the program and of torch eager from the same weights.

    ``model(*inputs)`` returns the loss as the program does; it is copied, so
    the caller's model is untouched. ``on_step(index, record)`` is called after
    every step (progress reporting).
    """
    session = TrainingSession(pte, lr, ptd=ptd)
    reference = copy.deepcopy(model)
    trainable = {n: p for n, p in reference.named_parameters() if p.requires_grad}
    optimizer = torch.optim.SGD(list(trainable.values()), lr=lr)
    initial = {n: p.detach().clone() for n, p in trainable.items()}
    records = []
    for index in range(steps):
        start = time.perf_counter()
        loss = session.step(inputs)
        seconds = time.perf_counter() - start
        optimizer.zero_grad(set_to_none=True)
        reference_loss = reference(*inputs)
        if isinstance(reference_loss, (tuple, list)):
            reference_loss = reference_loss[0]
        reference_loss.backward()
        optimizer.step()
        record = StepRecord(loss, float(reference_loss.detach()), seconds)
        records.append(record)
        if on_step is not None:
            on_step(index, record)
    params = session.parameters()
    missing = sorted(set(trainable) - set(params))
    if missing:
        session.close()
        raise RuntimeError(f"the program does not return these trainable parameters: {missing}")
    updates = {
        name: (params[name].detach() - initial[name], trainable[name].detach() - initial[name])
        for name in trainable
    }
    del params
    session.close()
    return TrainingRun(records, updates)


@dataclasses.dataclass
class TrainingProgram:
    """A joint program lowered for training: the edge program, ``lower()``'s report, the
    ``.pte`` bytes and how its state is named."""

    edge: Any  # executorch's EdgeProgramManager
    report: Any  # qnn_convbwd.Report
    pte: bytes
    lowering_seconds: float  # export_joint + lower + to_executorch
    layout: StateLayout
    ptd: bytes | None = None  # the tensor data file, with external_weights=True
    # The lowered edge program before ``to_executorch`` (which changes the program it
    # emits), so ``emit`` can write the same program with other initial values.
    unemitted: Any = dataclasses.field(default=None, repr=False)
    external_weights: bool = False
    # The optimizer the program applies itself (``lower_for_training(optimizer=...)``).
    optimizer: optimizer_pass.ProgramOptimizer | None = None

    def emit(self, state: Mapping[str, torch.Tensor]) -> tuple[bytes, bytes | None]:
        """The ``.pte`` (and ``.ptd``) of this program with ``state``'s values as the
        initial values of its trainable parameters and updated buffers; ``state`` by
        program names (``TrainingSession.program_state()``). The delegates are the same
        ones: nothing is lowered again."""
        if self.unemitted is None:
            raise RuntimeError("this TrainingProgram keeps no unemitted edge program")
        edge = copy.deepcopy(self.unemitted)
        exported = edge.exported_program()
        stored = {**exported.state_dict, **exported.constants}
        unknown = sorted(set(state) - set(stored))
        if unknown:
            raise StateDictError(f"not tensors of the program: {unknown}")
        with torch.no_grad():
            for name, value in state.items():
                if tuple(value.shape) != tuple(stored[name].shape):
                    raise StateDictError(
                        f"{name}: {tuple(value.shape)} given, {tuple(stored[name].shape)} in the "
                        "program"
                    )
                stored[name].copy_(value)
        return _emit(edge, self.external_weights)

    def session(
        self,
        lr: float | None = None,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        dampening: float = 0.0,
        nesterov: bool = False,
        *,
        etdump: bool = False,
    ) -> TrainingSession | ProgramOptimizerSession:
        """A fresh runtime of this program, from the module's initial values.

        A program lowered with ``optimizer=`` applies it itself: its session takes no
        arguments (``ProgramOptimizerSession``). Otherwise executorch's SGD with these
        options updates the parameters (``TrainingSession``; ``etdump``: recording
        executorch's ETDump, ``TrainingSession.write_etdump``)."""
        if self.optimizer is not None:
            if etdump:
                raise TypeError("etdump=True: not for a program that applies its own optimizer")
            sgd = {"momentum": momentum, "weight_decay": weight_decay, "dampening": dampening}
            given = [name for name, value in sgd.items() if value] + (["nesterov"] * nesterov)
            if lr is not None or given:
                raise TypeError(
                    f"this program applies its own {type(self.optimizer.optimizer).__name__}: "
                    "session() takes no optimizer arguments (set session.lr to change the "
                    "learning rate)"
                )
            return ProgramOptimizerSession(
                self.pte, self.optimizer, ptd=self.ptd, layout=self.layout
            )
        if lr is None:
            raise TypeError("session(): lr is required (executorch's SGD updates this program)")
        return TrainingSession(
            self.pte,
            lr,
            momentum=momentum,
            weight_decay=weight_decay,
            dampening=dampening,
            nesterov=nesterov,
            ptd=self.ptd,
            layout=self.layout,
            etdump=etdump,
        )


@progress.long_call("lowering")
def lower_for_training(
    module: torch.nn.Module,
    inputs: tuple,
    specs: list,
    *,
    external_weights: bool = False,
    optimizer: SGD | Adam | None = None,
    loss_scale: DynamicLossScale | None = None,
    **lower_options: Any,
) -> TrainingProgram:
    """``export_joint`` + ``qnn_convbwd.lower`` + ``to_executorch``: a program to train.

    ``module(*inputs)`` returns the loss (a ``WithLoss``, say); its state is named
    as the wrapped module's (``net.conv1.weight`` -> ``conv1.weight``) when all of
    it lives under one attribute. ``lower_options`` go to ``qnn_convbwd.lower``.
    Buffers the program updates are emitted with their names, so a session reads
    and writes them. ``external_weights``: parameters and constants go to a
    ``.ptd`` beside the program (``TrainingProgram.ptd``).

    ``optimizer`` (``SGD``, ``Adam``, ``AdamW``): the program applies it itself, so one
    call of its ``forward`` is one training step returning the loss
    (``passes.optimizer``); ``loss_scale`` (``DynamicLossScale``, with an optimizer
    only): the program keeps a dynamic loss scale as ``torch.amp.GradScaler`` does.

    A module holding pt2e-converted graphs (activation quantize / dequantize pairs) is
    lowered through a copy with the straight-through estimator
    (``quantized.straight_through``): the same forward values, and gradients through
    the quantized part to the parameters before or inside it; ``module`` is unchanged.
    """
    from .api import enabled, lower

    if quantized.holds_activation_pairs(module):
        module = copy.deepcopy(module)
        quantized.straight_through(module)

    if loss_scale is not None and optimizer is None:
        raise TypeError("loss_scale=DynamicLossScale(...) needs an in-program optimizer=")
    if optimizer is not None and options.current.loss_scale != 1.0:
        raise OptimizerError(
            f"the static loss_scale option ({options.current.loss_scale}) and an in-program "
            "optimizer do not combine: pass loss_scale=training.DynamicLossScale(...) instead"
        )
    start = time.perf_counter()
    joint = export_joint(module, inputs)
    names = [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]
    layout = StateLayout.from_program(joint, shared_prefix(names))
    stored: dict[str, tuple[int, ...]] = {}
    if options.current.weight_layout == "hwio" and options.current.weight_storage == "filter":
        joint, stored = filter_storage.store(joint)
    attached = None
    if optimizer is not None:
        joint, attached = optimizer_pass.attach(joint, optimizer, loss_scale)
    result = lower(joint, specs, **lower_options)
    try:
        unemitted = copy.deepcopy(result.edge)
    except Exception as err:  # executorch's verifier on the copy of a read-back program
        # An edge program read back from the lowering cache holds edge ops (a dim-order
        # cast) that executorch's verifier refuses when its delegates are deep-copied:
        # lower once more without that cache (the context binaries are still reused).
        logger.info("lowering again without the lowering cache: %s", type(err).__name__)
        with enabled(lowering_cache=False):
            result = lower(joint, specs, **lower_options)
        unemitted = copy.deepcopy(result.edge)
    if stored:
        for edge in (result.edge, unemitted):
            integration.add_constant_methods(
                edge, {filter_storage.METHOD: filter_storage.encode(stored)}
            )
    pte, ptd = _emit(result.edge, external_weights)
    seconds = time.perf_counter() - start
    return TrainingProgram(
        result.edge,
        result.report,
        pte,
        seconds,
        layout,
        ptd,
        unemitted,
        external_weights,
        optimizer=attached,
    )


def _emit(edge: Any, external_weights: bool) -> tuple[bytes, bytes | None]:
    """``edge.to_executorch`` (which changes ``edge``) for training: the ``.pte`` bytes and
    the ``.ptd`` with ``external_weights``."""
    from executorch.exir import ExecutorchBackendConfig

    from .api import enabled

    # Under enabled(): the training metadata of a program that updates buffers.
    config = ExecutorchBackendConfig(
        emit_mutable_buffer_names=True,
        external_mutable_weights=external_weights,
        external_constants=external_weights,
    )
    with enabled(), warnings.catch_warnings():
        # The plugin marks every buffer the program updates as initialised
        # (after_partition.py), which this warning of executorch's does not look at.
        warnings.filterwarnings("ignore", message="Mutation on a buffer in the model")
        program = edge.to_executorch(config)
    ptd = _tensor_data(program) if external_weights else None
    return bytes(program.buffer), ptd


def _tensor_data(program: Any) -> bytes:
    """The one ``.ptd`` an ExecutorchProgramManager writes for its external tensors."""
    with tempfile.TemporaryDirectory() as folder:
        program.write_tensor_data_to_file(folder)
        files = sorted(Path(folder).glob("*.ptd"))
        if len(files) != 1:
            raise RuntimeError(f"expected one tensor data file, executorch wrote {files}")
        return files[0].read_bytes()
