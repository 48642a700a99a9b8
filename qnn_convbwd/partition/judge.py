"""The one verdict: is this node delegated to QNN, and if not, why.

``judge(node, context)`` is asked by the partitioner (through the hook
``api`` installs on executorch's ``QnnOperatorSupport.is_node_supported``), by
the transform pass (``passes/canonicalize.py``, before it rewrites the nodes it
delegates) and by ``qnn_convbwd.decide``. It runs, in order:

1. the op's own rules: ``support`` (convolution_backward) and ``max_pool``
   (max_pool2d_with_indices_backward, and a forward max_pool2d_with_indices the
   transform pass gave its indices);
2. the graph rules below (``GRAPH``), for every node: executorch's skip
   options, trainable parameters read by a visitor that bakes them, nodes the
   plugin keeps on CPU, constants that follow their consumers;
3. executorch's own check (the partitioner only: it builds the node's QNN ops
   and asks the backend's op validation); when it refuses, the ``EXECUTORCH``
   rules say which of its reasons applies. Without a backend (``decide``, the
   transform pass) those rules run on their own and op validation is assumed.

Every rule is a named function registered in ``verdict.REGISTRY`` and returns a
``Rejection`` with its reason; the first one is the node's verdict, logged as one
INFO line ``<op> <node>: not delegated: <reason> (<values>)``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import operator
from collections.abc import Callable, Collection, Iterator

import torch

from .. import integration, nodes
from ..geometry import conv as geo
from ..meta import (
    GRAD_TO_TORCH,
    GRAD_VIEW,
    INDICES_CAST,
    INDICES_ON_HTP,
    NAME_SEEN,
    ON_CPU,
    OPTIMIZER,
    SHAPE_OF,
    UNSCALE,
    WEIGHT_TO_DEVICE,
    WEIGHT_VIEW,
)
from ..nodes import origins
from ..signature import trainable_parameters, trained_in_program
from . import avg_pool, cpu_kernel, max_pool, rewrites, support, trainable
from .target import MIN_HTP_ARCH, Target, below_min_arch
from .verdict import Decision, Fallback, Rejection, first_rejection, rules, settle

logger = logging.getLogger(__name__)

GRAPH = "graph"
EXECUTORCH = "executorch"
GRAPH_RULES, graph_rule = rules(GRAPH)
EXECUTORCH_RULES, executorch_rule = rules(EXECUTORCH)


@dataclasses.dataclass(frozen=True)
class Context:
    """What a verdict depends on besides the node."""

    target: Target
    skip_ids: frozenset[str] = frozenset()
    skip_ops: frozenset[str] = frozenset()
    # The verdict on another node (a constant's consumers, a getitem's producer);
    # None: ``judge`` on it, quietly, without executorch's check.
    delegated: Callable[[torch.fx.Node], bool] | None = None
    # Verdicts on other nodes, remembered for one partitioning (a forward max pool asks
    # about every node between it and its backward).
    memo: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def other_delegated(self, node: torch.fx.Node) -> bool:
        if node not in self.memo:
            if self.delegated is not None:
                self.memo[node] = self.delegated(node)
            else:
                return judge(node, self, log=False).supported
        return self.memo[node]


def op_name(node: torch.fx.Node) -> str:
    """The op's name as the log lines and reports show it (``convolution_backward``,
    ``aten.mean.dim``, ``getitem``)."""
    if nodes.is_conv_bwd(node):
        return "convolution_backward"
    if nodes.is_max_pool_backward(node):
        return max_pool.OP
    if nodes.is_max_pool_with_indices(node):
        return max_pool.FORWARD_OP
    if nodes.is_avg_pool_backward(node):
        return avg_pool.OP
    return getattr(node.target, "__name__", str(node.target))


def skip_name(node: torch.fx.Node) -> str:
    """The name executorch's skip_node_id_set is matched against: the name the transform
    pass saw (``meta.NAME_SEEN``), since later passes renumber nodes."""
    return node.meta.get(NAME_SEEN, node.name)


def _plugin_op(node: torch.fx.Node) -> bool:
    return (
        nodes.is_conv_bwd(node)
        or nodes.is_max_pool_backward(node)
        or nodes.is_avg_pool_backward(node)
    )


# --- graph rules: every node ---------------------------------------------------


@graph_rule
def skip_options(node, context):
    """executorch's skip_node_id_set / skip_node_op_set keep the node on CPU."""
    if node.target in integration.get("allow_list_operator"):
        return None  # executorch passes these before it reads the skip options
    name = skip_name(node)
    # A convolution_backward the transform pass lifted for the CPU (ON_CPU) whose
    # rules delegate it was kept there by the skip options the pass was given.
    lifted = _plugin_op(node) and bool(node.meta.get(ON_CPU))
    op = getattr(node.target, "__name__", "")
    if name in context.skip_ids or lifted or op in context.skip_ops:
        return Rejection("kept on CPU by executorch's skip options", "")
    return None


def _is_training_graph(node: torch.fx.Node, context: Context) -> bool:
    """The node's graph holds a backward op the plugin lowers (or a node it lifted for
    one kept on CPU), or its program trains parameters (a joint graph whose backward
    has none of those ops: a float head on a frozen backbone); remembered per graph
    for one partitioning."""
    key = ("training_graph", id(node.graph))
    if key not in context.memo:
        program = context.target.edge_program
        context.memo[key] = any(
            _plugin_op(other) or other.meta.get(ON_CPU) for other in node.graph.nodes
        ) or (
            program is not None
            and program.graph is node.graph
            and bool(trainable_parameters(program))
        )
    return context.memo[key]


@graph_rule
def training_graph_below_v69(node, context):
    """Below V69 a training graph runs on CPU as a whole: its backward ops stay there
    (the op rules' ``htp_arch_supported``), and delegating its forward ops between them
    fails QAIRT 2.51's context generation for V68 (measured on torchvision resnet18,
    bias-only: "could not create op" for an ``aten.mul.Tensor``): one all-CPU program
    instead of delegates interleaved with CPU backward ops. A joint graph whose
    backward has none of the plugin's ops fails there as well (measured, SM8350: a float
    head on a quantized CIFAR backbone, "could not create op" for the loss's
    ``ScatterElements``)."""
    target = context.target
    if not target.known or target.backend != "htp" or nodes.is_getitem_of(node, nodes.is_conv_bwd):
        return None  # a getitem follows its producer
    if not below_min_arch(target):
        return None
    if not _is_training_graph(node, context):
        return None
    return Rejection(
        f"a training graph stays on CPU below HTP V{MIN_HTP_ARCH}",
        f"soc={target.soc}, arch=V{target.htp_arch}",
    )


@graph_rule
def trainable_parameter_baked(node, context):
    """An executorch visitor that reads its operand's values would bake a trainable one."""
    why = trainable.refusal(node, context.target.edge_program)
    if why is None:
        return None
    return Rejection("reads a trainable parameter, which executorch's visitor bakes", why)


@graph_rule
def strided_scatter_not_a_block(node, context):
    """An ``as_strided_scatter`` that ``passes/strided_scatter.py`` could not write as a
    reshape or a pad of its source (``rewrites.scatter_refusal``)."""
    if not rewrites.is_scatter(node):
        return None
    why = rewrites.scatter_refusal(node)
    if why is None:
        return Rejection("the rewrite into a reshape or a pad (block_scatters) did not run")
    return Rejection(
        "not a block of its base, which the rewrite into a reshape or a pad needs", why
    )


@graph_rule
def adaptive_pool_not_static(node, context):
    """An adaptive average pool (or its backward) that ``passes/adaptive_pool.py`` could
    not write as products with averaging matrices (``rewrites.adaptive_pool_refusal``)."""
    if not rewrites.is_adaptive_pool(node):
        return None
    why = rewrites.adaptive_pool_refusal(node)
    if why is None:
        return Rejection("the rewrite into products (adaptive_pools) did not run")
    return Rejection("its averaging matrices need static floating-point shapes", why)


@graph_rule
def convolution_padding_reaches_kernel(node, context):
    """A forward convolution whose padding reaches its kernel's extent is garbage on the
    HTP (``geo.padding_reaches_filter``): it stays on CPU, where executorch's kernel is
    right. (The plugin's grad_weight convolutions of that kind compute only the taps
    that read data instead.)"""
    if not nodes.is_convolution(node):
        return None
    found = geo.forward_padding_reaches_kernel(node)
    if found is None:
        return None
    padding, extents = found
    return Rejection(
        "the HTP computes a convolution whose padding reaches its kernel's extent wrongly",
        f"padding={list(padding)}, kernel extent={extents}",
    )


@graph_rule
def lifted_for_cpu(node, context):
    """A node the transform pass added for a node it keeps on CPU (the reshapes of a
    1-D convolution_backward lifted to 2-D for executorch's CPU kernel, a max pool's
    int32 indices cast): it runs with that node."""
    if _plugin_op(node) or not node.meta.get(ON_CPU):
        return None
    return Rejection("prepares a node the plugin keeps on CPU", node.meta[ON_CPU])


@graph_rule
def loss_unscale(node, context):
    """The 1 / loss_scale of a gradient output: fp32 on CPU, where it is exact."""
    if not node.meta.get(UNSCALE):
        return None
    return Rejection("divides a gradient by the loss scale in fp32 on CPU", "loss_scale")


def _optimizer_role(node: torch.fx.Node) -> str | None:
    custom = node.meta.get("custom")
    return custom.get(OPTIMIZER) if isinstance(custom, dict) else None


@graph_rule
def optimizer_on_cpu(node, context):
    """The in-program optimizer's update (``passes.optimizer``): the parameters, the
    optimizer's state and the loss scale are updated in fp32 on CPU, from the gradients
    the delegate returns."""
    role = _optimizer_role(node)
    if role is None:
        return None
    return Rejection("the in-program optimizer updates in fp32 on CPU", role)


@graph_rule
def weight_layout_on_cpu(node, context):
    """The permutes between a trainable weight's torch layout and the delegate's
    (``passes.weight_layout``) run on CPU: exact, and the delegate's tensors keep
    the layout QAIRT finalises fast."""
    weight = node.meta.get(WEIGHT_TO_DEVICE) or node.meta.get(GRAD_TO_TORCH)
    if weight is None:
        return None
    return Rejection("moves a trainable weight between torch's layout and the delegate's", weight)


@graph_rule
def weight_view_follows_convolutions(node, context):
    """The permute of a trainable weight back to torch's layout that its convolutions
    read (``meta.WEIGHT_VIEW``), and the permute of their grad_weight to the delegate's
    layout (``meta.GRAD_VIEW``), go where the convolutions go: inside their delegate
    the visitors fold them away."""
    if node.meta.get(WEIGHT_VIEW):
        kept = [user.name for user in node.users if not context.other_delegated(user)]
        if kept:
            return Rejection("its convolutions stay on CPU", ", ".join(kept))
    elif node.meta.get(GRAD_VIEW):
        producer = node.args[0]
        if not context.other_delegated(producer):
            return Rejection("its convolution_backward stays on CPU", producer.name)
    return None


def _program_state(node: torch.fx.Node, context: Context) -> dict[torch.fx.Node, str]:
    """The nodes of ``node``'s graph that belong to the program's state (its mutated
    buffers: running statistics, counters), each with why it stays on CPU; remembered
    per graph for one partitioning (``program_state_on_cpu``)."""
    key = ("program_state", id(node.graph))
    if key not in context.memo:
        context.memo[key] = _state_nodes(node.graph, context.target.edge_program)
    return context.memo[key]


def _state_nodes(graph: torch.fx.Graph, program) -> dict[torch.fx.Node, str]:
    if program is None:
        return {}
    signature = program.graph_signature
    mutated = set(signature.buffers_to_mutate.values())
    if not mutated:
        return {}
    outputs = graph.output_node().args[0]
    if len(outputs) != len(signature.output_specs):
        return {}
    # The in-program optimizer's nodes have their own rule (``optimizer_on_cpu``); the
    # backward that computes the gradients they read is not state. Its parameters are
    # read like parameters, not state.
    trained = {n for n in graph.nodes if n.op == "placeholder" and trained_in_program(n)}
    mutations, other_outputs = set(), set()
    for value, spec in zip(outputs, signature.output_specs):
        if isinstance(value, torch.fx.Node) and _optimizer_role(value) is not None:
            continue
        is_mutation = spec.kind.name == "BUFFER_MUTATION"
        (mutations if is_mutation else other_outputs).add(value)
    stored = set(signature.inputs_to_lifted_tensor_constants) | {
        name for name, fqn in signature.inputs_to_buffers.items() if fqn not in mutated
    }
    found: dict[torch.fx.Node, str] = {}
    # Nodes whose every use is the next value of a mutated buffer.
    for n in reversed(graph.nodes):
        if n.op != "call_function" or not n.users or _optimizer_role(n) is not None:
            continue
        if all(
            found.get(user) == UPDATES_STATE
            or (user.op == "output" and n in mutations and n not in other_outputs)
            for user in n.users
        ):
            found[n] = UPDATES_STATE
    # Nodes computed from mutated buffers and constants alone (no input, no parameter).
    state = {
        n
        for n in graph.nodes
        if n.op == "placeholder"
        and signature.inputs_to_buffers.get(n.name) in mutated
        and n not in trained
    }
    constant = {n for n in graph.nodes if n.op == "placeholder" and n.name in stored}
    for n in graph.nodes:
        if n.op != "call_function" or n in found:
            continue
        operands = n.all_input_nodes
        if all(o in constant for o in operands):
            constant.add(n)
        elif all(o in constant or o in state for o in operands):
            state.add(n)
            found[n] = FROM_STATE
    # Constant ops read only by the state (a draw's element indices): with it on CPU.
    for n in reversed(graph.nodes):
        if n.op != "call_function" or n not in constant or not n.users:
            continue
        if all(user in found for user in n.users):
            found[n] = FEEDS_STATE
    return found


UPDATES_STATE = "computes the next value of a mutated buffer, in fp32 on CPU"
FROM_STATE = "computed from mutated buffers and constants alone: a CPU input of the delegate"
FEEDS_STATE = "a constant read only by the program's state, computed with it"


@graph_rule
def program_state_on_cpu(node, context):
    """The program's state stays on CPU: the running statistics' moving averages and a
    counter's increment (only the next value of a mutated buffer), and what is computed
    from the state alone (a random draw from a step counter), with the constants only
    the state reads (the draw's element indices). On the HTP a buffer's
    update would run in fp16, and a buffer read or written inside a delegate is not a
    buffer of the program (executorch then fails to emit it); on CPU it stays one, and
    the delegate takes what the update reads as an ordinary input or output."""
    why = _program_state(node, context).get(node)
    if why is None:
        return None
    return Rejection("the program's state stays on CPU", why)


@graph_rule
def constant_follows_consumers(node, context):
    """A constant (executorch's constant ops: full, scalar_tensor, arange, and the
    shape-only stand-ins the plugin inserts) is delegated only together with every
    consumer: alone it would be a constant delegate output, which QNN does not bind
    (the runtime then reads past its argument list)."""
    if not (node.meta.get(SHAPE_OF) or node.target in integration.get("constant_operator")):
        return None
    kept = [user.name for user in node.users if not context.other_delegated(user)]
    if not kept:
        return None
    return Rejection("a constant is delegated only with every consumer", ", ".join(kept))


@graph_rule
def indices_cast_follows_its_pool(node, context):
    """The int32 cast of a forward pool's indices (``meta.INDICES_CAST``) goes where the
    pool goes: inside its delegate it is an identity."""
    if not node.meta.get(INDICES_CAST):
        return None
    forward = node.args[0].args[0]
    if context.other_delegated(forward):
        return None
    return Rejection("its forward max pool stays on CPU", forward.name)


@graph_rule
def follows_its_producer(node, context):
    """A getitem of a convolution_backward stays where its producer runs."""
    if not nodes.is_getitem_of(node, nodes.is_conv_bwd):
        return None
    producer = node.args[0]
    if context.other_delegated(producer):
        return None
    return Rejection("its convolution_backward stays on CPU", producer.name)


# --- executorch's own reasons: QnnOperatorSupport.is_node_supported ------------------


@executorch_rule
def not_supported_operator(node, context):
    if node.target not in integration.get("not_supported_operator"):
        return None
    return Rejection(
        "executorch's QNN partitioner never delegates this op", "not_supported_operator"
    )


@executorch_rule
def to_be_implemented(node, context):
    if node.target not in integration.get("to_be_implemented_operator"):
        return None
    return Rejection(
        "executorch's QNN backend does not implement this op yet",
        "to_be_implemented_operator",
    )


@executorch_rule
def forced_fallback(node, context):
    key = integration.get("QCOM_FALLBACK_NODE")
    if not node.meta.get(key, False):
        return None
    return Rejection("marked to fall back to CPU", f"meta[{key!r}]")


@executorch_rule
def no_visitor(node, context):
    name = getattr(node.target, "__name__", str(node.target))
    if name in integration.get("_node_visitor_dict"):
        return None
    return Rejection("executorch's QNN backend has no visitor for this op", name)


def quantization(node: torch.fx.Node) -> str:
    """How ``node``'s output and tensor operands are quantized (executorch's
    ``QCOM_QUANT_ATTRS``), e.g. ``output uint8 scale=0.02 zero_point=128; input
    getitem_2 uint8 ...``; "" when none is."""
    key = integration.get("QCOM_QUANT_ATTRS")
    parts = []
    for role, tensor in (("output", node), *((f"input {a.name}", a) for a in node.all_input_nodes)):
        attrs = tensor.meta.get(key)
        if attrs:
            parts.append(f"{role} {support.describe_quantization(attrs)}")
    return "; ".join(parts)


@executorch_rule
def backend_validation(node, context):
    """Asked only when executorch's check refused the node for none of the reasons above.
    A quantized node's values name its quantization (the HTP takes an op's quantized
    forms only for some dtype combinations)."""
    quantized = quantization(node)
    return Rejection(
        "rejected by the QNN backend's op validation (or its visitor built no op)",
        f"{context.target.soc}; quantized: {quantized}" if quantized else context.target.soc,
    )


def _executorch_refusal(node: torch.fx.Node, context: Context, validated: bool) -> Rejection | None:
    """Which of executorch's reasons refuses ``node``; ``validated``: its check ran and
    refused it, so op validation is the reason when no other applies."""
    if node.target in integration.get("allow_list_operator"):
        return None
    asked = [
        (name, fn) for name, fn in EXECUTORCH_RULES if validated or fn is not backend_validation
    ]
    return first_rejection(asked, op_name(node), node, context)


def _forward_pool_rejection(node: torch.fx.Node, context: Context) -> Rejection | None:
    """A forward pool the transform pass gave its indices (``meta.INDICES_ON_HTP``):
    ``max_pool.decide_forward`` again, with the partitioner's view of the backwards and,
    in the partitioner, of every op between them."""
    between = context.other_delegated if context.delegated is not None else None
    decision = max_pool.decide_forward(
        node, context.target, context.other_delegated, between, log=False
    )
    return decision.rejection


def _rules_rejection(node: torch.fx.Node, context: Context) -> Rejection | None:
    if nodes.is_conv_bwd(node):
        found = support.decide(node, context.target, log=False).rejection
    elif nodes.is_max_pool_backward(node):
        found = max_pool.decide(node, context.target, log=False).rejection
    elif nodes.is_max_pool_with_indices(node) and node.meta.get(INDICES_ON_HTP):
        found = _forward_pool_rejection(node, context)
    elif nodes.is_avg_pool_backward(node):
        found = avg_pool.decide(node, context.target, log=False).rejection
    else:
        found = None
    if found is not None:
        return found
    return first_rejection(GRAPH_RULES, op_name(node), node, context)


def judge(
    node: torch.fx.Node,
    context: Context,
    executorch: Callable[..., bool] | None = None,
    log: bool = True,
) -> Decision:
    """The node's verdict; ``executorch(skip_node_id_set=None)`` is executorch's own check
    of it (the partitioner's hook passes it; None: the rules alone decide)."""
    rejection = _rules_rejection(node, context)
    if rejection is None and not nodes.is_getitem_of(node, nodes.is_conv_bwd):
        if executorch is None:
            rejection = _executorch_refusal(node, context, validated=False)
        # The skip options are applied above, by the name the transform pass saw; executorch
        # matches skip_node_id_set against the current name, which may be another node's.
        elif not executorch(skip_node_id_set=set()):
            rejection = _executorch_refusal(node, context, validated=True)
    # A getitem's verdict is its producer's, which logged it.
    log = log and (rejection is None or rejection.rule != "follows_its_producer")
    return settle(Decision(node.name, op_name(node), rejection), logger, log)


# --- the partitioner ------------------------------------------------------------------

# The verdicts of the lowering under way (``recording``): latest verdict per node name
# (and the names it was traced from). None: no lowering records them.
_recorded: contextvars.ContextVar[dict[str, Decision] | None] = contextvars.ContextVar(
    "qnn_convbwd_verdicts", default=None
)
# The builders' fallbacks of the lowering under way (``recording``), by (node, asked):
# a node is built while the partitioner validates it and again when it is compiled.
# Each with the names its node was traced from.
_fallbacks: contextvars.ContextVar[dict[tuple[str, str], tuple[Fallback, list[str]]] | None] = (
    contextvars.ContextVar("qnn_convbwd_fallbacks", default=None)
)
# True while a node's users are checked on its behalf (their verdicts are not logged twice).
_nested: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "qnn_convbwd_nested_check", default=False
)


@contextlib.contextmanager
def recording() -> Iterator[dict[str, Decision]]:
    """Record the verdicts taken inside the block (by the partitioner or ``record``), for
    one lowering: a new, empty record, which the block's end puts away again."""
    verdicts: dict[str, Decision] = {}
    token = _recorded.set(verdicts)
    fallbacks_token = _fallbacks.set({})
    try:
        yield verdicts
    finally:
        _fallbacks.reset(fallbacks_token)
        _recorded.reset(token)


def record_fallback(node: torch.fx.Node, asked: str, built: str, reason: str) -> None:
    """A builder builds ``node`` as ``built`` instead of ``asked`` (the options' choice),
    for ``reason``: logged once at INFO and kept for the lowering under way's report."""
    names = origins(node)
    fallback = Fallback(names[-1], op_name(node), asked, built, reason)
    kept = _fallbacks.get()
    if kept is not None and (fallback.node, asked) in kept:
        return
    if kept is not None:
        kept[(fallback.node, asked)] = (fallback, names)
    logger.info("%s", fallback.message())


def recorded_fallbacks(names: Collection[str] = ()) -> list[Fallback]:
    """The builders' fallbacks in the lowering under way (``recording``), in build order,
    each node named by the first name it was traced from among ``names`` (the nodes of
    the program being lowered), else by its earliest one."""
    found = []
    for fallback, traced in (_fallbacks.get() or {}).values():
        named = next((n for n in traced if n in names), fallback.node)
        found.append(dataclasses.replace(fallback, node=named))
    return found


def fallback_keys() -> frozenset[tuple[str, str]]:
    """The (node, asked) of the fallbacks recorded so far in the lowering under way."""
    return frozenset(_fallbacks.get() or ())


def fallbacks_since(keys: Collection[tuple[str, str]]) -> list[tuple]:
    """The fallbacks recorded since ``fallback_keys()`` returned ``keys``, in order,
    as ``merge_fallbacks`` takes them (a forked build sends them to its parent)."""
    return [(key, entry) for key, entry in (_fallbacks.get() or {}).items() if key not in keys]


def merge_fallbacks(entries: list[tuple]) -> None:
    """Add fallbacks recorded elsewhere (``fallbacks_since``) to the lowering under way."""
    kept = _fallbacks.get()
    if kept is None:
        return
    for key, entry in entries:
        kept.setdefault(key, entry)


def recorded(name: str) -> Decision | None:
    """The latest verdict on ``name`` in the lowering under way (``recording``)."""
    verdicts = _recorded.get()
    return None if verdicts is None else verdicts.get(name)


def record(node: torch.fx.Node, decision: Decision) -> None:
    """Keep ``decision`` for the lowering under way, if one is ``recording``."""
    verdicts = _recorded.get()
    if verdicts is None or nodes.is_call(node, operator.getitem):
        return  # a getitem's verdict is its producer's, traced from the producer's name
    # Only an op the plugin rewrites is recorded under the names it was traced from:
    # the nodes a pass adds for it (reshapes, casts) are traced from its name too.
    for name in origins(node) if _plugin_op(node) else [node.name]:
        verdicts[name] = decision


def in_partitioner(
    node: torch.fx.Node,
    context: Context,
    executorch: Callable[..., bool],
    ask: Callable[[torch.fx.Node], bool],
) -> bool:
    """executorch's ``is_node_supported`` for ``node``: the verdict, recorded and logged.

    ``executorch(skip_node_id_set=None)`` runs executorch's own check of ``node``;
    ``ask(other)`` the partitioner's check of another node (a constant's consumer).
    A convolution_backward asked about on another node's behalf is judged by the
    rules and the skip options without building its ops again.
    """
    nested = _nested.get()

    def delegated(other: torch.fx.Node) -> bool:
        if nodes.is_conv_bwd(other):
            return judge(other, quiet, log=False).supported
        token = _nested.set(True)  # the node logs its own verdict when visited
        try:
            return ask(other)
        finally:
            _nested.reset(token)

    quiet = dataclasses.replace(context, delegated=None)
    here = dataclasses.replace(context, delegated=delegated)
    # A max pool backward's rules spoke in the transform pass, which rewrote the
    # node for the CPU if they kept it there: not logged a second time.
    log = not nested and not nodes.is_max_pool_backward(node)
    verdict = judge(node, here, executorch, log=log)
    record(node, verdict)
    if not verdict.supported and not nested:
        _warn_about_consequences(node, verdict)
    return verdict.supported


def _warn_about_consequences(node: torch.fx.Node, verdict: Decision) -> None:
    """One warning for a node whose place on CPU fails or is wrong at run time."""
    if nodes.is_conv_bwd(node):
        try:
            why = cpu_kernel.refusal(geo.parse(node))
        except geo.ConvArgumentError:
            return
        if why is not None:
            logger.warning(cpu_kernel.warning(node.name, why))
    elif nodes.is_max_pool_with_indices(node) and node.meta.get(INDICES_ON_HTP):
        logger.warning(
            "%s %s: prepared for the HTP with its indices, then refused by the partitioner "
            "(%s): its backwards read int64 indices from CPU and are kept on CPU with "
            "executorch's kernel, which computes them wrong (docs/max_pool.md)",
            max_pool.FORWARD_OP,
            node.name,
            verdict.reason,
        )
    elif nodes.is_avg_pool_backward(node):
        logger.warning(
            "%s %s: stays on CPU (%s), where executorch 1.5.1's runtime has no kernel for "
            "it: the program fails to load",
            avg_pool.OP,
            node.name,
            verdict.reason,
        )
    elif rewrites.missing_cpu_kernel(node):
        logger.warning(
            "%s %s: stays on CPU (%s), where executorch 1.5.1's runtime has no kernel for "
            "it: the program fails to load",
            op_name(node),
            node.name,
            verdict.reason,
        )
    elif nodes.is_max_pool_backward(node) and verdict.rejection.rule == "backend_validation":
        logger.warning(
            "%s %s: rejected by the QNN backend's op validation on %s after it was "
            "prepared for QNN (int32 indices): executorch's CPU kernel cannot run it",
            max_pool.OP,
            node.name,
            verdict.rejection.values,
        )
