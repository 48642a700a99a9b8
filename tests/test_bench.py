"""qnn_convbwd_dev.bench: counts on lowered programs, the three lowerings, crash isolation,
report."""

from __future__ import annotations

import copy
import json
import os
import signal
import struct

import pytest
import torch

from qnn_convbwd_dev import bench, bench_report

# --- helpers for the simulator worker (module level: the spawned worker imports them) ------


def _crashing_worker(pte: bytes, inputs: list, log_path: str) -> list:
    with open(log_path, "w") as log:
        log.write("[QnnExecuTorchBackend.cpp:163] Method forward: the binary and the program ")
        log.write("disagree on the delegate signature\n")
    os.kill(os.getpid(), signal.SIGSEGV)
    return []


def _echo_worker(pte: bytes, inputs: list, log_path: str) -> list:
    return [t * 2 for t in inputs] + [torch.tensor(float(len(pte)))]


# --- pure parts ----------------------------------------------------------------------------


def test_error_text_names_the_failing_pass_and_the_root_cause():
    try:
        try:
            raise AttributeError("'NoneType' object has no attribute 'dtype'")
        except AttributeError as inner:
            raise Exception(
                "An error occurred when running the 'I64toI32' pass after the following "
                "passes: ['DecomposeMinMaxDim', 'Remove0DTensor']"
            ) from inner
    except Exception as err:
        text = bench.error_text(err)
    assert text == "I64toI32 pass: AttributeError: 'NoneType' object has no attribute 'dtype'"
    assert bench.error_text(ValueError("x" * 500), limit=40).endswith("...")


def test_scaling_summary_growth_and_plugin_over_kept_ratio():
    def point(depth, mode, seconds, process_seconds, kib, nodes):
        return {
            "depth": depth,
            "mode": mode,
            "median_seconds": seconds,
            "median_process_seconds": process_seconds,
            "peak_delta_kib": kib,
            "joint_call_function_nodes": nodes,
            "parameter_bytes": nodes * 40,
        }

    points = [
        point(1, "plugin", 10.0, 12.0, 1024, 100),
        point(1, "kept_on_cpu", 8.0, 10.0, 2048, 100),
        point(2, "plugin", 20.0, 24.0, 3072, 200),
        point(2, "kept_on_cpu", 16.0, 20.0, 2048, 200),
        {"depth": 4, "mode": "plugin", "error": "exit 1: boom"},
        point(4, "kept_on_cpu", 40.0, 40.0, 4096, 400),
    ]
    rows = bench.scaling_summary(points, [1, 2, 4])
    assert rows[1]["plugin"]["time_growth"] == pytest.approx(2.0)
    assert rows[1]["plugin"]["process_time_growth"] == pytest.approx(2.0)
    assert rows[1]["plugin"]["memory_growth"] == pytest.approx(3.0)
    assert rows[1]["kept_on_cpu"]["node_growth"] == pytest.approx(2.0)
    assert rows[1]["time_ratio"] == pytest.approx(1.25)
    assert rows[1]["process_time_ratio"] == pytest.approx(1.2)
    assert rows[1]["memory_ratio"] == pytest.approx(1.5)
    assert rows[2]["plugin"] is None and "time_ratio" not in rows[2]
    assert bench.scaling_growth_line(rows) == "growth: n/a (a scaling point failed)"
    assert bench.scaling_growth_line(rows[:2]) == (
        "x1 -> x2: joint graph nodes 2.00x, weight bytes 2.00x; "
        "lowering CPU time plugin 2.00x, kept on CPU 2.00x; "
        "peak RSS increase plugin 3.00x, kept on CPU 1.00x; CPU time plugin/kept 1.20 -> 1.20"
    )
    table = bench.scaling_table(rows)
    assert (
        "| x2 | 2.00 | 2.00 | 20.00 | 24.00 | 2.00 | 3.0 | 3.00 | 16.00 | 20.00 | 2.00 |" in table
    )
    assert "| 1.25 | 1.20 | 1.50 |" in table
    assert "error" in table.splitlines()[-1]


def _graph_result() -> bench.GraphResult:
    spec = bench.GraphSpec("resnet", 16, False)
    plugin = bench.ModeResult(
        "plugin", partitions=1, cpu_ops=2, conv_bwd_on_cpu=1, conv_bwd_delegated=5
    )
    plugin.static_bytes, plugin.context_binary_bytes = 33420, 172288
    plugin.lower_seconds, plugin.max_abs_error, plugin.extra_outputs = [3.0, 1.0, 2.0], 6e-5, 1
    plugin.lower_process_seconds = [2.5, 0.5, 1.5]
    plugin.fidelity_outside, plugin.fidelity_tensors = 0, 7
    plugin.fidelity_worst = "backbone.0.weight 0.00066 (0.0009)"
    cpu = bench.ModeResult(
        "kept_on_cpu", partitions=5, cpu_ops=12, conv_bwd_on_cpu=11, conv_bwd_delegated=0
    )
    cpu.lower_seconds, cpu.run_error = [2.0], "RuntimeError: simulator process crashed: boom"
    plain = bench.ModeResult("plain", error="I64toI32 pass: AttributeError: x")
    return bench.GraphResult(
        spec, 6, 80, 33376, 102656, {"plugin": plugin, "kept_on_cpu": cpu, "plain": plain}
    )


def test_markdown_table_shows_failures_instead_of_numbers():
    rows = bench.markdown_table([_graph_result()]).splitlines()[2:]
    plugin, cpu, plain = rows
    assert plugin.startswith("| resnet 16px frozen | plugin | 1 | 2 | 1 of 6 | 33,420 / 33,376 |")
    assert "| 172,288 / 102,656 | 2.00 / 1.50 | 6.0e-05 |" in plugin  # medians
    assert "| within; worst backbone.0.weight 0.00066 (0.0009) |" in plugin
    assert "1 output(s) beyond the signature" in plugin
    assert cpu.startswith(
        "| resnet 16px frozen | plugin, conv_bwd kept on CPU | 5 | 12 | 11 of 11 (6 exported) |"
    )
    crashed = "simulator: `RuntimeError: simulator process crashed: boom`"
    assert f"| run failed | n/a | {crashed} |" in cpu
    assert "| — | — |" in plain and "lowering fails: `I64toI32 pass: AttributeError: x`" in plain


def test_fidelity_cell_counts_the_tensors_outside():
    result = bench.ModeResult("plugin", fidelity_outside=2, fidelity_tensors=7)
    result.fidelity_worst = "adapter.bias 0.31 (0.05)"
    assert bench_report._fidelity_cell(result) == "2 of 7 outside; worst adapter.bias 0.31 (0.05)"
    assert bench_report._fidelity_cell(bench.ModeResult("plugin")) == "n/a"  # not run


def test_charts_are_drawn_from_the_json_report(tmp_path):
    report = {
        "graphs": [_graph_result().to_json()],
        "scaling": {
            "points": [
                {
                    "depth": d,
                    "mode": m,
                    "median_seconds": d * 1.0,
                    "median_process_seconds": d * 1.5,
                    "peak_delta_kib": 1024 * d,
                }
                for d in (1, 2, 4)
                for m in bench.SCALING_MODES
            ]
        },
    }
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(report))
    drawn = bench.draw_charts(path, tmp_path)
    assert drawn == [tmp_path / "bench.png", tmp_path / "scaling.png"]
    for png in drawn:
        head = png.read_bytes()[:24]
        assert head[:8] == b"\x89PNG\r\n\x1a\n"
        width, height = struct.unpack(">II", head[16:24])
        assert width >= 600 and height >= 300


def test_simulator_turns_a_worker_crash_into_an_error_and_recovers():
    with bench.Simulator(worker=_crashing_worker) as sim:
        with pytest.raises(RuntimeError, match="crashed: .*disagree on the delegate signature"):
            sim.run(b"pte", [torch.ones(2)])
        sim.worker = _echo_worker  # the next run gets a fresh worker process
        out = sim.run(b"abc", [torch.ones(2)])
    assert torch.equal(out[0], torch.full((2,), 2.0)) and out[1].item() == 3.0


# --- real lowerings -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_graph():
    from qnn_convbwd_dev.models import training_graph

    return training_graph("resnet", size=8, depth=1)


@pytest.mark.htp
def test_counts_on_lowered_programs_with_and_without_the_plugin(qnn_sdk, small_graph):
    import qnn_convbwd
    from qnn_convbwd.toolchain import harness

    specs = harness.compile_specs("SM8650")
    total = bench.count_conv_bwd(small_graph.program)
    assert total == 6  # five backbone convolutions and the adapter

    result = qnn_convbwd.lower(copy.deepcopy(small_graph.program), specs)
    counts = bench.graph_counts(result.edge.exported_program().graph_module)
    on_cpu = [r for r in result.report.rows if not r.delegated]
    assert counts["conv_bwd_on_cpu"] == len(on_cpu) < total
    assert counts["conv_bwd_on_cpu"] + counts["conv_bwd_delegated"] >= total  # splits add nodes
    assert counts["partitions"] == harness.delegate_count(result.edge)

    kept = bench.lower_with_plugin(copy.deepcopy(small_graph.program), specs, {bench.CONV_BWD})
    graph = kept.exported_program().graph_module
    counts_kept = bench.graph_counts(graph)
    assert counts_kept["conv_bwd_on_cpu"] == total and counts_kept["conv_bwd_delegated"] == 0
    cpu_targets = [
        getattr(n.target, "__name__", "")
        for n in graph.graph.nodes
        if n.op == "call_function" and "convolution_backward" in str(n.target)
    ]
    assert cpu_targets == [bench.CONV_BWD] * total
    assert counts_kept["cpu_ops"] > counts["cpu_ops"]


@pytest.mark.htp
def test_plain_executorch_cannot_lower_the_joint_graph(qnn_sdk, small_graph):
    import qnn_convbwd
    from qnn_convbwd.toolchain import harness

    assert not qnn_convbwd.is_enabled()
    with pytest.raises(Exception) as info:
        bench.lower_plain(copy.deepcopy(small_graph.program), harness.compile_specs("SM8650"))
    assert bench.error_text(info.value).startswith("I64toI32 pass: ")
    with qnn_convbwd.enabled(), pytest.raises(RuntimeError, match="plugin disabled"):
        bench.lower_plain(small_graph.program, harness.compile_specs("SM8650"))


@pytest.mark.htp
@pytest.mark.slow(
    reason="the bench's whole run of one graph (five lowerings); the counts it records "
    "are checked on lowered programs by test_counts_on_lowered_programs_*"
)
def test_measure_graph_records_every_mode(qnn_sdk):
    spec = bench.GraphSpec("resnet", 8, trainable_backbone=False)
    with bench.Simulator() as sim:
        result = bench.measure_graph(spec, "SM8650", repeats=1, simulator=sim)
    plugin, cpu, plain = (result.modes[m] for m in bench.MODES)
    assert result.conv_bwd_nodes == 6
    assert plugin.error is None and plugin.run_error is None
    assert plugin.max_abs_error < 1e-2
    assert plugin.fidelity_outside == 0, plugin.fidelity_worst
    assert plugin.fidelity_tensors == 3  # the loss, the adapter's weight and bias gradients
    assert plugin.conv_bwd_on_cpu < cpu.conv_bwd_on_cpu == 6
    assert plugin.context_binary_bytes > result.forward_context_binary_bytes > 0
    assert len(plugin.lower_seconds) == 1 and plugin.median_seconds > 0
    # The kept-on-CPU program is recorded whatever happens on the simulator.
    assert (cpu.run_error is None) != (cpu.max_abs_error is None)
    assert plain.error and plain.partitions is None
    assert json.dumps(result.to_json())
