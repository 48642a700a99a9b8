"""The one verdict (``partition.judge``) and its one registry of named rules.

Every rule registered in ``partition.verdict.REGISTRY`` is produced here by a
node it is written for (``REACH``), and ``test_every_registered_rule_is_reached``
fails when a rule is registered without such a node. ``decide()`` lists every op
kept on CPU with its reason, not only convolution_backward.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import cases
import pytest
import torch
from executorch.exir import to_edge
from torch import nn

import qnn_convbwd
from qnn_convbwd import integration, meta, nodes
from qnn_convbwd.partition import judge, support, verdict
from qnn_convbwd.partition.target import Target
from qnn_convbwd_dev import models

SOC = "SM8650"


def htp(program, soc: str = SOC, arch: int | None = 75, backend: str = "htp") -> Target:
    return Target(backend=backend, soc=soc, htp_arch=arch, saver=False, edge_program=program)


def _first(program, predicate) -> torch.fx.Node:
    return next(n for n in program.graph.nodes if predicate(n))


def _of(op_name: str) -> Callable[[torch.fx.Node], bool]:
    return lambda n: n.op == "call_function" and getattr(n.target, "__name__", "") == op_name


# --- graphs the rules are written for ----------------------------------------------------


class _Ops(nn.Module):
    """One of each op executorch refuses or the plugin's graph rules look at."""

    def forward(self, x):
        y = torch.relu(x) + torch.full((1, 3, 4, 4), 2.0)
        others = torch.neg(x), torch.tanh(x), torch.sigmoid(x)
        return y.mean(), x.le(0.5), torch.clone(x).sum(), *others


@pytest.fixture
def ops_program():
    return _ops_program()


class _Pool(nn.Module):
    def __init__(self, kernel, dtype=torch.float32):
        super().__init__()
        self.kernel, self.dtype = kernel, dtype

    def forward(self, grad, x, indices):
        k = self.kernel
        return torch.ops.aten.max_pool2d_with_indices_backward(
            grad, x, [k, k], [k, k], [0, 0], [1, 1], False, indices
        )


@functools.cache
def _pool_program(kernel=2, dtype=torch.float32):
    x = torch.randn(1, 2, 2 * kernel, 2 * kernel, dtype=dtype)
    out, indices = torch.ops.aten.max_pool2d_with_indices(x, [kernel] * 2, [kernel] * 2)
    grad = torch.randn(*out.shape, dtype=dtype)
    with qnn_convbwd.enabled():
        program = torch.export.export(_Pool(kernel, dtype), (grad, x, indices))
        return to_edge(program).exported_program()


def _conv_case(name: str, fresh: bool = False):
    built = cases.CASE_BY_NAME[name].build() if fresh else _built(name)
    (node,) = cases.conv_backward_nodes(built.program.graph)
    return node, judge.Context(htp(built.program))


@functools.cache
def _built(name: str) -> cases.Built:
    return cases.CASE_BY_NAME[name].build()


def _case_with_rule(rule: str) -> str:
    """A case the rule rejects as the builders are today, else one it rejects when the
    capabilities it needs are withdrawn."""
    with_rule = [c for c in cases.CASES if c.rule == rule]
    today = [c for c in with_rule if not c.supported(support.CAPABILITIES)]
    return (today or with_rule)[0].name


def _capabilities(key) -> frozenset[str]:
    family, rule = key
    if family != CONV or (family, rule) not in CASE_RULES:
        return support.CAPABILITIES
    case = cases.CASE_BY_NAME[_case_with_rule(rule)]
    return WITHDRAWN if case.supported(support.CAPABILITIES) else support.CAPABILITIES


# (family, rule) -> () -> (node, context, executorch's check or None)
Reach = Callable[[], tuple[torch.fx.Node, judge.Context, Callable[..., bool] | None]]
REACH: dict[tuple[str, str], Reach] = {}


def reaches(family: str, rule: str):
    def register(fn: Reach) -> Reach:
        REACH[(family, rule)] = fn
        return fn

    return register


CONV = "convolution_backward"
# Rules the builders' capabilities silence today: reached with them withdrawn.
WITHDRAWN = frozenset({"grad_input", "conv2d"})
for _rule in {c.rule for c in cases.CASES if c.rule}:

    def _from_case(rule=_rule):
        node, context = _conv_case(_case_with_rule(rule))
        return node, context, None

    REACH[(CONV, _rule)] = _from_case
CASE_RULES = set(REACH)


@reaches(CONV, "backend_is_htp")
def _gpu():
    node, context = _conv_case("plain")
    return node, judge.Context(htp(context.target.edge_program, backend="gpu")), None


@reaches(CONV, "htp_arch_supported")
def _v68():
    node, context = _conv_case("plain")
    return node, judge.Context(htp(context.target.edge_program, "SM8350", 68)), None


@reaches(CONV, "not_quantized")
def _quantized():
    node, context = _conv_case("plain", fresh=True)
    node.args[0].meta[integration.get("QCOM_QUANT_ATTRS")] = {"scale": 0.1}
    return node, context, None


POOL = "max_pool2d_with_indices_backward"


def _pool(program, **target) -> tuple:
    node = _first(program, nodes.is_max_pool_backward)
    return node, judge.Context(htp(program, **target)), None


@reaches(POOL, "windows_fit")
def _pool_wrong_size():
    program = _pool_program.__wrapped__()  # its own: the test edits a shape
    node = _first(program, nodes.is_max_pool_backward)
    grad = node.args[0]
    grad.meta["val"] = torch.empty(1, 2, 3, 3)  # not the pooled size of the 4x4 input
    return node, judge.Context(htp(program)), None


FORWARD = "max_pool2d_with_indices"


class _PoolAndBackward(nn.Module):
    """A forward pool whose indices only its backward reads."""

    def __init__(self, kernel):
        super().__init__()
        self.kernel = kernel

    def forward(self, grad, x):
        k = [self.kernel] * 2
        values, indices = torch.ops.aten.max_pool2d_with_indices(x, k, k)
        grad_input = torch.ops.aten.max_pool2d_with_indices_backward(
            grad, x, k, k, [0, 0], [1, 1], False, indices
        )
        return values, grad_input


@functools.cache
def _forward_program(kernel=2, dtype=torch.float32):
    """The pool marked ``INDICES_ON_HTP``, as the transform pass marks one it delegates."""
    x = torch.randn(1, 2, 2 * kernel, 2 * kernel, dtype=dtype)
    grad = torch.randn(1, 2, 2, 2, dtype=dtype)
    with qnn_convbwd.enabled():
        exported = torch.export.export(_PoolAndBackward(kernel), (grad, x))
        program = to_edge(exported).exported_program()
    _first(program, nodes.is_max_pool_with_indices).meta[meta.INDICES_ON_HTP] = True
    return program


def _forward(program, skip_ids=frozenset(), **target) -> tuple:
    node = _first(program, nodes.is_max_pool_with_indices)
    return node, judge.Context(htp(program, **target), skip_ids=skip_ids), None


# The four target rules the forward pool shares with its backward, for both: the rule,
# the program's arguments and the target's.
SHARED_POOL_RULES = {
    "backend_is_htp": ({}, {"backend": "gpu"}),
    "htp_arch_supported": ({}, {"soc": "SM8350", "arch": 68}),
    "float_gradient": ({"dtype": torch.float64}, {}),
    "window_size": ({"kernel": 8}, {}),
}
for _family, _program, _case in (
    (POOL, _pool_program, _pool),
    (FORWARD, _forward_program, _forward),
):
    for _rule, (_built_with, _target) in SHARED_POOL_RULES.items():

        def _shared(program=_program, case=_case, built_with=_built_with, target=_target):
            return case(program(**built_with), **target)

        REACH[(_family, _rule)] = _shared


@reaches(FORWARD, "indices_users_delegated")
def _forward_backward_on_cpu():
    program = _forward_program()
    backward = _first(program, nodes.is_max_pool_backward)
    # The backward's own rules delegate it; the skip options keep it on CPU.
    return _forward(program, skip_ids=frozenset({backward.name}))


AVG = "avg_pool2d_backward"


@functools.cache
def _avg_pool_program(kernel=2):
    x = torch.randn(1, 2, 2 * kernel, 2 * kernel)
    grad = torch.randn(1, 2, 2, 2)

    class _AvgPool(nn.Module):
        def forward(self, grad, x):
            k = [kernel] * 2
            return torch.ops.aten.avg_pool2d_backward(grad, x, k, k, [0, 0], False, True, None)

    with qnn_convbwd.enabled():
        return to_edge(torch.export.export(_AvgPool(), (grad, x))).exported_program()


for _rule, (_built_with, _target) in {
    "backend_is_htp": ({}, {"backend": "gpu"}),
    "htp_arch_supported": ({}, {"soc": "SM8350", "arch": 68}),
    "window_size": ({"kernel": 16}, {}),
}.items():

    def _avg(built_with=_built_with, target=_target):
        program = _avg_pool_program(**built_with)
        node = _first(program, nodes.is_avg_pool_backward)
        return node, judge.Context(htp(program, **target)), None

    REACH[(AVG, _rule)] = _avg


GRAPH, ET = judge.GRAPH, judge.EXECUTORCH


@reaches(GRAPH, "skip_options")
def _skipped():
    node, context = _conv_case("plain")
    return node, judge.Context(context.target, skip_ids=frozenset({node.name})), None


@reaches(GRAPH, "training_graph_below_v69")
def _training_on_v68():
    from torch.export.experimental import _export_forward_backward

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x):
            return torch.relu(self.conv(x)).sum()

    joint = _export_forward_backward(torch.export.export(Loss(), (torch.randn(1, 3, 6, 6),)))
    program = to_edge(joint).exported_program()
    relu = _first(program, _of("aten.relu.default"))
    return relu, judge.Context(htp(program, "SM8350", 68)), None


class _Views(nn.Module):
    """An as_strided_scatter whose view is no block of its base (transposed strides)
    and an adaptive average pool, in a plain to_edge program: no plugin pass ran."""

    def forward(self, src, x):
        base = torch.full([12], 0.0)
        scatter = torch.as_strided_scatter(base, src, [2, 2], [1, 2], 0)
        return scatter, torch.ops.aten._adaptive_avg_pool2d(x, [3, 3])


@functools.cache
def _views_program():
    from executorch.exir import EdgeCompileConfig

    with qnn_convbwd.enabled():
        exported = torch.export.export(_Views(), (torch.randn(2, 2), torch.randn(1, 2, 5, 5)))
        config = EdgeCompileConfig(_check_ir_validity=False)  # as_strided_scatter: not core
        return to_edge(exported, compile_config=config).exported_program()


@reaches(GRAPH, "strided_scatter_not_a_block")
def _scatter():
    program = _views_program()
    return _first(program, _of("aten.as_strided_scatter.default")), _ctx(program), None


@reaches(GRAPH, "adaptive_pool_not_static")
def _adaptive_pool():
    program = _views_program()
    return _first(program, _of("aten._adaptive_avg_pool2d.default")), _ctx(program), None


@reaches(GRAPH, "trainable_parameter_baked")
def _trainable_norm():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 1), nn.GroupNorm(2, 4))
    for name, parameter in net.named_parameters():
        parameter.requires_grad_(name == "1.bias")

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, x):
            return self.net(x).sum()

    from torch.export.experimental import _export_forward_backward

    joint = _export_forward_backward(torch.export.export(Loss(), (torch.randn(1, 3, 4, 4),)))
    program = to_edge(joint).exported_program()
    return _first(program, _of("aten.native_group_norm.default")), judge.Context(htp(program)), None


@reaches(GRAPH, "convolution_padding_reaches_kernel")
def _padding_reaches_kernel():
    conv = nn.Conv2d(4, 4, 2, padding=2, bias=False).eval()
    program = to_edge(torch.export.export(conv, (torch.randn(1, 4, 6, 6),))).exported_program()
    return _first(program, nodes.is_convolution), judge.Context(htp(program)), None


@reaches(GRAPH, "lifted_for_cpu")
def _lifted():
    program = _ops_program()
    node = _first(program, _of("aten.neg.default"))
    node.meta[meta.ON_CPU] = "a_lifted_convolution_backward"
    return node, judge.Context(htp(program)), None


class _Counter(nn.Module):
    """Mutates a buffer: its increment is the next value of the program's state."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.steps.add_(1)
        return x.relu()


@reaches(GRAPH, "program_state_on_cpu")
def _program_state():
    with qnn_convbwd.enabled():
        exported = torch.export.export(_Counter(), (torch.randn(1, 3, 4, 4),))
        program = to_edge(exported).exported_program()
    return _first(program, _of("aten.add.Tensor")), judge.Context(htp(program)), None


@reaches(GRAPH, "loss_unscale")
def _unscale():
    program = _ops_program()
    node = _first(program, _of("aten.add.Tensor"))
    node.meta[meta.UNSCALE] = True
    return node, judge.Context(htp(program)), None


@reaches(GRAPH, "optimizer_on_cpu")
def _optimizer_update():
    """The next value of a trained weight, computed by the in-program optimizer from
    the weight and its gradient (nothing else would keep it on CPU)."""
    from torch.export.experimental import _export_forward_backward

    from qnn_convbwd.passes import optimizer

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x):
            return torch.relu(self.conv(x)).sum()

    joint = _export_forward_backward(torch.export.export(Loss(), (torch.randn(1, 3, 6, 6),)))
    program, _ = optimizer.attach(joint, optimizer.AdamW(1e-3))
    with qnn_convbwd.enabled():
        edge = to_edge(program).exported_program()
    outputs = zip(edge.graph_signature.output_specs, edge.graph.output_node().args[0])
    (update,) = [value for spec, value in outputs if spec.target == "conv.weight"]
    return update, judge.Context(htp(edge)), None


@reaches(GRAPH, "weight_layout_on_cpu")
def _weight_to_device():
    program = _ops_program()
    node = _first(program, _of("aten.sum.dim_IntList"))
    node.meta[meta.WEIGHT_TO_DEVICE] = "p_conv_weight"
    return node, judge.Context(htp(program)), None


@reaches(GRAPH, "weight_view_follows_convolutions")
def _weight_view():
    program = _ops_program()
    node = _first(program, _of("dim_order_ops._clone_dim_order.default"))
    node.meta[meta.WEIGHT_VIEW] = "p_conv_weight"
    reader = next(iter(node.users))  # stands for the convolution, kept on CPU
    return node, judge.Context(htp(program), skip_ids=frozenset({reader.name})), None


@reaches(GRAPH, "constant_follows_consumers")
def _constant():
    program = _ops_program()
    node = _first(program, _of("aten.full.default"))
    add = next(iter(node.users))
    context = judge.Context(htp(program), skip_ids=frozenset({add.name}))
    return node, context, None


@reaches(GRAPH, "indices_cast_follows_its_pool")
def _indices_cast():
    program = _ops_program()
    # Any node two calls below another stands for the cast of a pool's indices (getitem).
    node = next(
        n
        for n in program.graph.nodes
        if n.op == "call_function"
        and n.args
        and isinstance(n.args[0], torch.fx.Node)
        and n.args[0].op == "call_function"
        and n.args[0].args
        and isinstance(n.args[0].args[0], torch.fx.Node)
        and n.args[0].args[0].op == "call_function"
    )
    node.meta[meta.INDICES_CAST] = True
    forward = node.args[0].args[0]  # kept on CPU by the skip options
    return node, judge.Context(htp(program), skip_ids=frozenset({forward.name})), None


@reaches(GRAPH, "follows_its_producer")
def _getitem():
    node, context = _conv_case("transposed")
    getitem = next(u for u in node.users if nodes.is_getitem_of(u, nodes.is_conv_bwd))
    return getitem, context, None


@reaches(ET, "not_supported_operator")
def _clone():
    program = _ops_program()
    return _first(program, _of("dim_order_ops._clone_dim_order.default")), _ctx(program), None


@reaches(ET, "to_be_implemented")
def _le_scalar():
    program = _ops_program()
    return _first(program, _of("aten.le.Scalar")), _ctx(program), None


@reaches(ET, "forced_fallback")
def _fallback():
    program = _ops_program()
    node = _first(program, _of("aten.sigmoid.default"))
    node.meta[integration.get("QCOM_FALLBACK_NODE")] = True
    return node, _ctx(program), None


@reaches(ET, "no_visitor")
def _mean():
    program = _ops_program()
    return _first(program, _of("aten.mean.default")), _ctx(program), None


@reaches(ET, "backend_validation")
def _validation():
    program = _ops_program()
    # executorch's own check, as the partitioner passes it, refusing the node.
    return _first(program, _of("aten.tanh.default")), _ctx(program), lambda **_: False


def _ctx(program) -> judge.Context:
    return judge.Context(htp(program))


@functools.lru_cache(maxsize=1)
def _ops_program():
    """One program for the rules on any op; each rule's metadata goes on its own node."""
    with qnn_convbwd.enabled():
        exported = torch.export.export(_Ops(), (torch.randn(1, 3, 4, 4),))
        return to_edge(exported).exported_program()


# --- the tests ---------------------------------------------------------------------------


def test_every_registered_rule_is_reached():
    """A rule in the registry without a node that triggers it fails here."""
    with qnn_convbwd.enabled():
        registered = set(verdict.registered())
    assert {family for family, _ in registered} >= {CONV, POOL, FORWARD, AVG, GRAPH, ET}
    assert registered - set(REACH) == set(), "registered rules nothing reaches"
    assert set(REACH) - registered == set(), "REACH names rules that are not registered"


@pytest.mark.parametrize("key", sorted(REACH), ids=lambda k: f"{k[0]}:{k[1]}")
def test_the_rule_is_the_verdict(key, caplog, monkeypatch):
    family, rule = key
    monkeypatch.setattr(support, "CAPABILITIES", _capabilities(key))
    with qnn_convbwd.enabled():
        node, context, executorch = REACH[key]()
        caplog.set_level(logging.INFO, logger="qnn_convbwd")
        found = judge.judge(node, context, executorch)
    assert found.rejection is not None, f"{node.name} delegated, expected {rule}"
    assert found.rejection.rule == rule, found.rejection
    assert found.op == judge.op_name(node) and found.reason
    logged = [r for r in caplog.records if getattr(r, "convbwd_node", None) == node.name]
    if rule == "follows_its_producer":
        assert logged == []  # its producer says why
    else:
        assert [r.convbwd_rule for r in logged] == [rule]
        assert logged[0].getMessage() == found.rejection.message(node.name)
        assert logged[0].levelno == logging.INFO


def test_executorchs_verdict_stands_when_no_rule_refuses(ops_program):
    """No rule refuses a relu: executorch's check decides, and its yes is the verdict."""
    with qnn_convbwd.enabled():
        relu = _first(ops_program, _of("aten.relu.default"))
        context = _ctx(ops_program)
        assert judge.judge(relu, context).supported  # no backend: the rules alone
        assert judge.judge(relu, context, lambda **_: True).supported
        assert not judge.judge(relu, context, lambda **_: False, log=False).supported


def test_op_validation_names_the_quantization_of_a_quantized_node():
    """A float op reading a quantized tensor (what QNN refused before
    passes.quant_boundary's copy: Reshape UFIXED_POINT_8 -> FLOAT_32) is reported with
    its operand's quantization; a float op with the SoC alone."""
    import copy

    program = copy.deepcopy(_ops_program())
    key = integration.get("QCOM_QUANT_ATTRS")
    with qnn_convbwd.enabled():
        tanh = _first(program, _of("aten.tanh.default"))
        context = _ctx(program)
        assert judge.backend_validation(tanh, context).values == SOC
        (operand,) = tanh.all_input_nodes
        operand.meta[key] = {"dtype": torch.uint8, "scale": 0.0125, "zero_point": 128}
        rejection = judge.backend_validation(tanh, context)
    assert rejection.values == (
        f"{SOC}; quantized: input {operand.name} uint8 scale=0.0125 zero_point=128"
    )


def test_forward_pool_with_a_delegated_backward_passes_its_rules():
    """The same pool that ``indices_users_delegated`` refuses with its backward on CPU
    is delegated when the backward is: the rule looks at the backward's verdict."""
    program = _forward_program()
    with qnn_convbwd.enabled():
        node, context, _ = _forward(program)
        assert judge.judge(node, context, log=False).supported
        backward = _first(program, nodes.is_max_pool_backward)
        refused = judge.judge(node, judge.Context(context.target, skip_ids={backward.name}))
    assert refused.rejection.rule == "indices_users_delegated"
    assert refused.rejection.values == f"backward={backward.name}"


def test_decide_lists_every_op_kept_on_cpu_with_its_reason():
    """The demo graph with a skipped op: every op on CPU is in the report, on V75 and on
    V68 (where the whole training graph stays on CPU)."""
    from qnn_convbwd.toolchain import harness

    graph = models.training_graph("demo", size=9)

    def on_cpu(soc):
        report = qnn_convbwd.decide(
            graph.program, harness.compile_specs(soc), skip_node_op_set={"aten.relu.default"}
        )
        by_rule: dict[str, set[str]] = {}
        for op in report.on_cpu:
            by_rule.setdefault(op.rule, set()).add(op.op)
        assert "aten.relu.default" in by_rule["skip_options"]
        assert not any(op.op == "getitem" for op in report.on_cpu)
        return report, by_rule

    report, by_rule = on_cpu("SM8650")
    assert "aten.mean.default" in by_rule["no_visitor"]
    assert "| no_visitor |" in report.on_cpu_markdown()
    assert "convolution_backward" not in {op.op for op in report.on_cpu}

    report, by_rule = on_cpu("SM8350")
    assert by_rule["htp_arch_supported"] == {"convolution_backward"}
    assert len([op for op in report.on_cpu if op.op == "convolution_backward"]) == len(report.rows)
    assert "aten.mean.default" in by_rule["training_graph_below_v69"]
    assert set(by_rule) == {"htp_arch_supported", "training_graph_below_v69", "skip_options"}


# --- an unknown target ------------------------------------------------------------------


class _ConvPool(nn.Module):
    """Two convolutions around a max pool: one backward asks for every gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Conv2d(3, 4, 3, padding=1)
        self.second = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        y = nn.functional.max_pool2d(torch.relu(self.first(x)), 2)
        return (self.second(y) ** 2).mean()


def _conv_pool_program():
    from qnn_convbwd.training import export_joint

    with qnn_convbwd.enabled():
        joint = export_joint(_ConvPool(), (torch.randn(1, 3, 8, 8),))
        return to_edge(joint).exported_program()


def _op_decisions(program, target: Target) -> list[verdict.Decision]:
    from qnn_convbwd.partition import max_pool

    found = []
    for node in program.graph.nodes:
        if nodes.is_conv_bwd(node):
            found.append(support.decide(node, target, log=False))
        elif nodes.is_max_pool_backward(node):
            found.append(max_pool.decide(node, target, log=False))
    return found


def test_an_unknown_target_waits_for_the_partitioner_only_where_it_decides_again():
    """The policy for an unknown target (``partition/target.py``): convolution_backward,
    which the partitioner judges again with the real target, is prepared for the HTP;
    a max pool backward, which the transform pass settles for good, is made right on
    CPU. Once the target is known, both ops land on the same side."""
    from qnn_convbwd import pipeline

    canonicalize = pipeline.at("edge")[-1].run
    program = _conv_pool_program()
    unknown = {d.op: d for d in _op_decisions(program, Target.unknown(program))}
    assert unknown["convolution_backward"].supported
    pool = unknown["max_pool2d_with_indices_backward"].rejection
    assert (pool.rule, pool.values) == ("backend_is_htp", "no compile specs")

    for target, rule in (
        (htp(program), None),
        (htp(program, "SM8350", 68), "htp_arch_supported"),
        (htp(program, backend="gpu"), "backend_is_htp"),
        (htp(program, "SM0000", None), "htp_arch_supported"),
    ):
        decisions = _op_decisions(program, target)
        assert len(decisions) == 3
        assert {None if d.supported else d.rejection.rule for d in decisions} == {rule}, target

    # The transform pass without compile specs: the backward asking for every gradient is
    # split for the HTP (the partitioner decides on the halves), none is pinned on CPU;
    # the max pool backward is rewritten for CPU.
    with qnn_convbwd.enabled():
        canonicalize(edge_program=program)(program.graph_module)
    convs = [n for n in program.graph.nodes if nodes.is_conv_bwd(n)]
    assert len(convs) == 3
    assert not any(n.meta.get(meta.PINNED) or n.meta.get(meta.ON_CPU) for n in convs)
    assert not any(nodes.is_max_pool_backward(n) for n in program.graph.nodes)


# --- verdicts belong to one lowering ------------------------------------------------------


def test_recorded_verdicts_belong_to_one_lowering():
    """A lowering sees only the verdicts recorded inside its own ``recording`` block: not
    an outer one's, not another thread's, and nothing is kept outside any lowering (the
    stock flow after ``enable()``)."""
    import threading

    program = _pool_program()
    node = _first(program, nodes.is_max_pool_backward)
    accepted = verdict.Decision(node.name, "op", None)
    refused = verdict.Decision(node.name, "op", verdict.Rejection("no", rule="r", op="op"))

    judge.record(node, refused)  # no lowering under way: kept nowhere
    assert judge.recorded(node.name) is None
    with judge.recording() as outer:
        judge.record(node, accepted)
        with judge.recording() as inner:
            assert judge.recorded(node.name) is None
            judge.record(node, refused)
            assert judge.recorded(node.name) is refused
        assert judge.recorded(node.name) is accepted
    # (a plugin op is recorded under every name it was traced from, its own among them)
    assert outer[node.name] is accepted and all(v is accepted for v in outer.values())
    assert inner[node.name] is refused and all(v is refused for v in inner.values())
    assert judge.recorded(node.name) is None

    # Two lowerings interleaved on two threads.
    both_recorded, seen = threading.Barrier(2), {}

    def lowering(decision: verdict.Decision) -> None:
        with judge.recording():
            judge.record(node, decision)
            both_recorded.wait(timeout=30)
            seen[decision.supported] = judge.recorded(node.name)

    threads = [threading.Thread(target=lowering, args=(d,)) for d in (accepted, refused)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert seen == {True: accepted, False: refused}
