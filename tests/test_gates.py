"""Partitioner gates: every variant is either delegated with the right numbers or
stays on CPU, says why once, and still computes torch's numbers.

The variants come from ``tests/cases.py``; whether one is expected to be
delegated follows from ``partition.support.CAPABILITIES``, so widening the
lowering turns its fallback test into a delegation test without editing this file.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import textwrap

import cases
import pytest
import torch
from tiers import sweep

from qnn_convbwd.partition import support
from qnn_convbwd.partition.target import MIN_HTP_ARCH, Target

SOC = "SM8650"
NOT_DELEGATED = re.compile(r"^convolution_backward (\S+): not delegated: (.*)$")
CPU_CANNOT_RUN = re.compile(
    r"^convolution_backward (\S+): stays on CPU, where executorch's CPU kernel cannot execute it"
)


# --- helpers ---------------------------------------------------------------------------


def not_delegated_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if NOT_DELEGATED.match(r.getMessage())]


def cpu_cannot_run_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if CPU_CANNOT_RUN.match(r.getMessage())]


def lower(built: cases.Built, soc: str, caplog):
    from qnn_convbwd.toolchain import harness

    caplog.set_level(logging.INFO, logger="qnn_convbwd")
    caplog.clear()
    return harness.lower_program(built.program, soc)


def lowered_graphs(edge) -> list[torch.fx.Graph]:
    from executorch.exir.lowered_backend_module import get_lowered_submodules

    graph_module = edge.exported_program().graph_module
    return [m.original_module.graph for _, m, _ in get_lowered_submodules(graph_module)]


def assert_on_cpu(edge) -> torch.fx.Node:
    """The node is in the top-level graph (in whatever dialect) and in no delegate."""
    top = cases.conv_backward_nodes(edge.exported_program().graph)
    assert len(top) == 1, f"top-level graph has {len(top)} convolution_backward nodes"
    for graph in lowered_graphs(edge):
        assert not cases.conv_backward_nodes(graph), "convolution_backward inside a delegate"
    return top[0]


def cpu_kernel_can_run(node: torch.fx.Node) -> bool:
    """What executorch's portable convolution_backward kernel computes: 2-D, not transposed."""
    return node.args[0].meta["val"].dim() == 4 and not node.args[7]  # grad_output, transposed


def assert_delegated(edge) -> None:
    """No node in the top-level graph; the node (possibly split by the plugin's
    passes into grad_input and grad_weight/grad_bias halves) inside a delegate."""
    assert not cases.conv_backward_nodes(edge.exported_program().graph)
    inside = [n for g in lowered_graphs(edge) for n in cases.conv_backward_nodes(g)]
    assert inside, "no convolution_backward inside the delegates"


def assert_cpu_numbers(compiled, built: cases.Built) -> None:
    for inputs in [built.inputs, *built.more_inputs]:
        cases.assert_matches(
            compiled.run(inputs),
            built.expected(inputs),
            built.magnitude(inputs),
            cases.cpu_rtol(built.config),
            f"CPU fallback, batch {inputs[0].shape[0]}",
        )


def assert_htp_numbers(compiled, built: cases.Built) -> None:
    for inputs in [built.inputs, *built.more_inputs]:
        cases.assert_matches(
            compiled.run(inputs),
            built.expected(inputs),
            built.magnitude(inputs),
            cases.FP16_RTOL,
            "HTP simulator",
        )


_RUN_IN_CHILD = textwrap.dedent(
    """
    import sys, torch
    from qnn_convbwd.toolchain.harness import run_pte
    outputs = run_pte(open(sys.argv[1], "rb").read(), torch.load(sys.argv[2]))
    torch.save(outputs, sys.argv[3])
    """
)


def run_in_child(pte: bytes, inputs, tmp_path) -> subprocess.CompletedProcess:
    """Run a program in another process: executorch's Python runtime can crash on errors."""
    (tmp_path / "p.pte").write_bytes(pte)
    torch.save(list(inputs), tmp_path / "in.pt")
    return subprocess.run(
        [sys.executable, "-c", _RUN_IN_CHILD, *(str(tmp_path / f) for f in ("p.pte", "in.pt"))]
        + [str(tmp_path / "out.pt")],
        capture_output=True,
        text=True,
        timeout=300,
    )


def conv_node(program: torch.export.ExportedProgram) -> torch.fx.Node:
    (node,) = cases.conv_backward_nodes(program.graph)
    return node


def htp_target(program, soc: str = SOC, arch: int = 75) -> Target:
    """The Target compile specs for ``soc`` describe, without needing the SDK."""
    return Target(backend="htp", soc=soc, htp_arch=arch, saver=False, edge_program=program)


# --- the variant table, end to end on the simulator --------------------------------------


@pytest.mark.htp
@pytest.mark.parametrize("case", cases.CASES, ids=cases.case_ids(cases.CASES))
def test_variant(case: cases.Case, qnn_sdk, caplog, tmp_path):
    built = case.build()
    compiled = lower(built, SOC, caplog)
    (row,) = compiled.report.rows
    records = not_delegated_records(caplog)

    if case.supported(support.CAPABILITIES):
        assert row.delegated, row.reason
        assert not records, [r.getMessage() for r in records]
        assert_delegated(compiled.edge)
        assert_htp_numbers(compiled, built)
        return

    assert not row.delegated
    node = assert_on_cpu(compiled.edge)
    assert len(records) == 1, [r.getMessage() for r in records]
    (record,) = records
    assert record.convbwd_rule == case.rule, record.getMessage()
    assert NOT_DELEGATED.match(record.getMessage()).group(2) == row.reason

    # 1-D nodes are lifted to 2-D; transposed and 3-D ones cannot be, and the
    # report and one warning say that the CPU kernel cannot execute them.
    executable = case.config.spatial_dims in (1, 2) and not case.config.transposed
    assert cpu_kernel_can_run(node) == executable, node.format_node()
    warnings = cpu_cannot_run_records(caplog)
    if cpu_kernel_can_run(node):
        assert row.cpu_refusal is None and not warnings, row.summary
    else:
        assert row.cpu_refusal, row
        assert [CPU_CANNOT_RUN.match(r.getMessage()).group(1) for r in warnings] == [
            record.convbwd_node
        ]
        assert "cannot execute" in row.summary and row.cpu_refusal in row.summary

    if case.cpu_kernel_refuses is None:
        assert cpu_kernel_can_run(node), "a node the CPU kernel refuses is expected to run"
        assert_cpu_numbers(compiled, built)
        return
    # executorch's CPU kernel cannot compute this node either: the program must
    # fail loudly at run time, not return garbage.
    if case.torch_rejects:
        with pytest.raises(RuntimeError, match="Expected a tensor of dimension"):
            built.expected(built.inputs)
    else:
        built.expected(built.inputs)  # torch computes it; only executorch's kernel cannot
    child = run_in_child(compiled.pte, built.inputs, tmp_path)
    assert child.returncode != 0, "the CPU kernel accepted a node it is expected to refuse"
    assert not (tmp_path / "out.pt").exists()
    assert case.cpu_kernel_refuses in child.stderr, child.stderr[-2000:]


# --- the rules read the capability set ---------------------------------------------------


WIDENABLE = [c for c in cases.CASES if c.needs is not None and c.rule is not None]


@pytest.mark.parametrize("case", WIDENABLE, ids=cases.case_ids(WIDENABLE))
def test_capability_lifts_its_rule(case: cases.Case, monkeypatch):
    """Granting a case's capabilities silences its rule; withdrawing them brings it back."""
    built = case.build()
    node = conv_node(built.program)
    target = htp_target(built.program)

    monkeypatch.setattr(support, "CAPABILITIES", case.needs)
    granted = support.decide(node, target, log=False)
    assert granted.supported, granted.rejection

    monkeypatch.setattr(support, "CAPABILITIES", frozenset({"grad_input", "conv2d"}))
    withheld = support.decide(node, target, log=False)
    assert withheld.rejection is not None and withheld.rejection.rule == case.rule


def test_withdrawing_conv2d_rejects_the_plain_case(monkeypatch):
    built = cases.CASE_BY_NAME["plain"].build()
    monkeypatch.setattr(support, "CAPABILITIES", frozenset({"grad_input"}))
    decision = support.decide(conv_node(built.program), htp_target(built.program), log=False)
    assert decision.rejection is not None and decision.rejection.rule == "spatial_dims"


def test_case_table_names_real_rules_and_capabilities():
    rule_names = {name for name, _ in support.RULES}
    for case in cases.CASES:
        assert case.rule is None or case.rule in rule_names, case.name
        assert case.needs is None or case.needs <= support.KNOWN_CAPABILITIES, case.name
        if case.rule is None:
            assert case.supported(support.CAPABILITIES), f"{case.name} has no rule to reject it"
    assert support.CAPABILITIES <= support.KNOWN_CAPABILITIES


def test_one_log_line_per_rejection(caplog):
    """decide() logs its rejection once, with the rule attached, and nothing when silent."""
    built = cases.CASE_BY_NAME["transposed"].build()
    node = conv_node(built.program)
    caplog.set_level(logging.INFO, logger="qnn_convbwd")
    decision = support.decide(node, htp_target(built.program))
    assert support.decide(node, htp_target(built.program), log=False) == decision
    (record,) = not_delegated_records(caplog)
    assert record.convbwd_rule == "not_transposed" and record.convbwd_node == node.name
    assert record.getMessage() == decision.rejection.message(node.name)
    assert record.getMessage().endswith("(transposed=True)")


# --- HTP architecture ------------------------------------------------------------------------


@pytest.fixture
def define_node_calls(monkeypatch):
    """Counts the visitor's define_node calls: the first step of QNN backend validation."""
    from qnn_convbwd.builders.op_convolution_backward import ConvolutionBackwardVisitor

    calls: list[str] = []
    original = ConvolutionBackwardVisitor.define_node

    def spy(self, node, nodes_to_wrappers):
        calls.append(node.name)
        return original(self, node, nodes_to_wrappers)

    monkeypatch.setattr(ConvolutionBackwardVisitor, "define_node", spy)
    return calls


def _soc_arch() -> dict[str, int]:
    from qnn_convbwd.toolchain.harness import SOC_ARCH

    return SOC_ARCH


# The two sides of the gate, V68 and V69; the later arches (delegated like V69) with
# --slow. Every SoC compiles and runs in test_toolchain.py's small CNN.
@pytest.mark.htp
@pytest.mark.parametrize(
    "soc", sweep(["SM8350", "SM8450"], [s for s in _soc_arch() if _soc_arch()[s] > 69])
)
def test_htp_arch_gate(soc: str, qnn_sdk, caplog, define_node_calls):
    arch = _soc_arch()[soc]
    built = cases.build(cases.ConvConfig(stride=(2, 2), input_size=(9, 9)))
    compiled = lower(built, soc, caplog)
    (row,) = compiled.report.rows
    records = not_delegated_records(caplog)
    if arch < MIN_HTP_ARCH:
        assert not row.delegated
        assert [r.convbwd_rule for r in records] == ["htp_arch_supported"]
        assert f"arch=V{arch}" in row.reason
        # Rejected before executorch's check builds the op for backend validation.
        assert define_node_calls == []
        assert_on_cpu(compiled.edge)
        assert_cpu_numbers(compiled, built)
    else:
        assert row.delegated, row.reason
        assert not records
        assert define_node_calls, "the visitor was never asked to build the node"
        assert_delegated(compiled.edge)
        from qnn_convbwd.toolchain.harness import delegate_count

        assert delegate_count(compiled.edge) == 1
        assert_htp_numbers(compiled, built)


# --- non-HTP backends ---------------------------------------------------------------------------


def _non_htp_specs(backend: str) -> list:
    from executorch.backends.qualcomm.serialization.qc_schema import QcomChipset
    from executorch.backends.qualcomm.utils import utils

    if backend == "gpu":
        return utils.generate_qnn_executorch_compiler_spec(
            QcomChipset.SM8650, utils.generate_gpu_compiler_spec()
        )
    # executorch allows LPAI only on SoCs with an LPAI core.
    return utils.generate_qnn_executorch_compiler_spec(
        QcomChipset.SM8850, utils.generate_lpai_compiler_spec()
    )


class _NoBackend:
    """Stands in for the QnnManager: records any use (there must be none)."""

    def __init__(self) -> None:
        self.used: list[str] = []

    def __getattr__(self, name):
        self.used.append(name)
        raise AssertionError(f"the QNN backend was queried ({name}) for a rejected node")


# executorch's LPAI spec reads the QAIRT version from the SDK's libraries.
@pytest.mark.parametrize("backend", ["gpu", pytest.param("lpai", marks=pytest.mark.htp)])
def test_non_htp_backend_rejected_before_any_backend_query(
    backend, plugin, monkeypatch, caplog, define_node_calls
):
    """Partition level: executorch's QnnOperatorSupport (patched by the plugin) with
    GPU/LPAI compile specs rejects the node and its getitems without touching the
    backend. No QnnManager can be created for these backends here (no GPU/LPAI
    library on x86-64), so a recorder stands in for it."""
    from executorch.backends.qualcomm.partition import qnn_partitioner
    from executorch.exir import to_edge

    specs = _non_htp_specs(backend)
    target = Target.from_compile_specs(specs)
    assert target.backend == backend

    no_backend = _NoBackend()
    monkeypatch.setattr(qnn_partitioner, "get_current_qnn_manager", lambda *a: no_backend)
    built = cases.build(cases.ConvConfig())
    edge_program = to_edge(built.program).exported_program()
    checker = qnn_partitioner.QnnOperatorSupport(edge_program, specs, set(), set())

    caplog.set_level(logging.INFO, logger="qnn_convbwd")
    node = conv_node(edge_program)
    assert checker.is_node_supported(None, node) is False
    for user in node.users:
        assert checker.is_node_supported(None, user) is False, user.name
    assert no_backend.used == [] and define_node_calls == []
    (record,) = not_delegated_records(caplog)
    assert record.convbwd_rule == "backend_is_htp"
    assert f"backend={backend}" in record.getMessage()


@pytest.mark.htp
@pytest.mark.parametrize("backend", ["gpu", "lpai"])
def test_non_htp_backend_full_lowering(backend, qnn_sdk, caplog):
    """End to end when executorch can open the backend here; skipped with its error if not.

    On the x86-64 hosts this was written on neither opens: executorch loads
    libQnnGpu.so by name and the SDK's lib dir is not on the loader path; with
    it on LD_LIBRARY_PATH, QNN GPU refuses ("TuningMode must be enabled on
    x86_64-linux-clang platforms"), an option executorch 1.5.1 does not set.
    The onnxruntime-qnn wheel ships no LPAI library.
    """
    from executorch.backends.qualcomm.utils.qnn_manager_lifecycle import QnnManagerContext

    import qnn_convbwd

    specs = _non_htp_specs(backend)
    try:
        with QnnManagerContext({"forward": specs}):
            pass
    except RuntimeError as err:
        pytest.skip(f"executorch cannot open the QNN {backend} backend here: {err}")
    built = cases.build(cases.ConvConfig())
    caplog.set_level(logging.INFO, logger="qnn_convbwd")
    result = qnn_convbwd.lower(built.program, specs)
    (row,) = result.report.rows
    assert not row.delegated and "backend is not HTP" in row.reason
    assert [r.convbwd_rule for r in not_delegated_records(caplog)] == ["backend_is_htp"]
