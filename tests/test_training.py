"""Training through ExecuTorch's training runtime on the HTP simulator.

The lowered joint program is loaded by ``TrainingModule``; ExecuTorch's SGD
optimizer updates its parameters in place, and every following step must
compute with the updated values on the HTP. Each test runs several steps next
to torch eager + ``torch.optim.SGD`` from the same weights.
"""

from __future__ import annotations

import pytest
import torch

import qnn_convbwd
from qnn_convbwd import integration, training
from qnn_convbwd.toolchain import harness, saver
from qnn_convbwd_dev import models

pytestmark = pytest.mark.htp

SOC = "SM8650"
STEPS = 5
LR = 0.1


def lower(case: models.TrainingCase, soc: str = SOC):
    with integration.capture_qnn_graphs() as graphs:
        result = qnn_convbwd.lower(case.joint(), harness.compile_specs(soc))
    return result, graphs


def assert_trains_like_torch(run: training.TrainingRun) -> None:
    for index, step in enumerate(run.steps):
        gap = abs(step.loss - step.reference_loss)
        assert gap <= 3e-2 * max(1.0, abs(step.reference_loss)), (index, step)
    assert run.update_cosine() >= 0.98, run.update_cosine()
    assert 0.8 <= run.update_norm_ratio() <= 1.25, run.update_norm_ratio()


def delegate_inputs(edge) -> dict[str, str]:
    """Delegate input node name -> the placeholder whose value it carries: the input
    itself, or the parameter a permute on CPU moves to the filter layout
    (``weight_layout="hwio"``)."""
    graph = edge.exported_program().graph
    calls = [n for n in graph.nodes if "executorch_call_delegate" in str(n.target)]
    args = [a for call in calls for a in call.args[1:] if isinstance(a, torch.fx.Node)]

    def carried(node: torch.fx.Node) -> str:
        source = node.args[0] if "permute_copy" in str(node.target) else None
        return (
            source.name
            if isinstance(source, torch.fx.Node) and source.op == "placeholder"
            else node.name
        )

    return {a.name: carried(a) for a in args}


@pytest.fixture(scope="module", params=["frozen", "trainable"])
def demo(request, demo_on_sm8650):
    """The demo lowered for SM8650 (conftest's ``demo_on_sm8650``, shared with
    test_weight_layout): (case, delegate inputs, QNN graphs, .pte)."""
    case, _, graphs, inputs, pte = demo_on_sm8650(request.param == "trainable")
    return case, inputs, graphs, pte


def test_trainable_parameters_are_delegate_inputs(demo):
    case, inputs, graphs, _ = demo
    trainable = {n for n, p in case.model.named_parameters() if p.requires_grad}
    frozen = {n for n, p in case.model.named_parameters() if not p.requires_grad}
    placeholder = {name: "p_" + name.replace(".", "_") for name in trainable | frozen}
    assert {placeholder[n] for n in trainable} <= set(inputs.values())
    assert not {placeholder[n] for n in frozen} & set(inputs.values())
    # Inside the QNN graph a trainable tensor is an input the app writes, never static.
    tensors = {t.name: t for ops in graphs for op in ops for t in (*op.inputs, *op.outputs)}
    for name in trainable:
        carriers = [node for node, value in inputs.items() if value == placeholder[name]]
        matching = [t for t in tensors.values() if any(t.name.endswith(c + "@0") for c in carriers)]
        assert matching and all(t.kind.endswith("APP_WRITE") for t in matching), name
        assert not any(placeholder[name] in t.name and t.is_static for t in tensors.values())


def test_training_metadata_methods(demo):
    _, _, _, pte = demo
    session = training.TrainingSession(pte, LR)
    module = session.module.model
    grads_at = module.run_method("__et_training_gradients_index_forward", ())[0]
    params_at = module.run_method("__et_training_parameters_index_forward", ())[0]
    names = module.run_method("__et_training_fqn_forward", ())
    assert 1 <= grads_at < params_at
    assert params_at - grads_at == len(names)


def test_demo_trains_like_torch(demo):
    case, _, _, pte = demo
    run = training.train_side_by_side(pte, case.model, case.inputs, STEPS, LR)
    assert_trains_like_torch(run)
    # The optimizer reached every trainable tensor, and each moved as torch's did.
    for name, (ours, theirs) in run.updates.items():
        assert ours.norm() > 0, name
        cosine = torch.nn.functional.cosine_similarity(ours.flatten(), theirs.flatten(), dim=0)
        assert cosine >= 0.98, (name, float(cosine))


def test_frozen_weight_static_and_stored_once(qnn_sdk):
    """Saver record of the frozen-backbone demo: the adapter (trainable) is a graph input,
    each frozen convolution weight stored once (runtime_weight: a head and a tail)."""
    case = models.adapter_case("demo", trainable=False)
    graph = saver.record(case.joint(), SOC)
    # The adapter's weight enters as torch's OIHW or, by default, the filter layout HWIO.
    adapter = case.model.adapter.weight.detach()
    layouts = {tuple(adapter.shape), tuple(adapter.permute(2, 3, 1, 0).shape)}
    entering = [
        t.name
        for t in graph.tensors.values()
        if t.dims in layouts and graph.producer(t.name) is None
    ]
    assert entering and all(graph.tensors[n].type == "APP_WRITE" for n in entering), entering
    assert not any("p_adapter_weight" in t.name for t in graph.static_inputs())
    frozen = {
        n: p for n, p in case.model.named_parameters() if not p.requires_grad and p.dim() == 4
    }
    assert frozen
    for name, value in frozen.items():
        placeholder = "p_" + name.replace(".", "_")
        stored = sum(
            t.numel for t in graph.static_inputs() if t.data is not None and placeholder in t.name
        )
        assert stored == value.numel(), (name, stored)


@pytest.mark.parametrize("trainable", [True, False], ids=["trainable", "frozen-features"])
def test_executorch_cifar_example_trains_like_torch(trainable, cifar_on_sm8650):
    """ExecuTorch's own CIFAR-10 model (3 conv + 2x2 max pool, 2 linear with biases),
    cross-entropy with int64 labels, batch 4, 32x32: every convolution_backward and
    max-pool backward delegated. (The trainable lowering is shared with
    test_max_pool_forward.py's fidelity check.)"""
    case, _, compiled = cifar_on_sm8650(trainable)
    assert compiled.report.delegated == len(compiled.report.rows)
    top = compiled.edge.exported_program().graph
    kept = {getattr(n.target, "__name__", "") for n in top.nodes if n.op == "call_function"}
    assert not any("backward" in name for name in kept), kept
    run = training.train_side_by_side(compiled.pte, case.model, case.inputs, STEPS, 0.05)
    assert_trains_like_torch(run)


def test_external_weights_program_trains(qnn_sdk):
    """``external_mutable_weights`` + ``external_constants``: the trained weights live in
    the .ptd beside the program, as in ExecuTorch's CIFAR example."""
    from executorch.exir import ExecutorchBackendConfig

    case = models.adapter_case("demo", trainable=True)
    result, _ = lower(case)
    program = result.edge.to_executorch(
        ExecutorchBackendConfig(external_mutable_weights=True, external_constants=True)
    )
    data = program._tensor_data
    assert data, "no external tensor data"
    (ptd,) = [bytes(blob) for blob in _serialized_tensor_data(program)]
    run = training.train_side_by_side(program.buffer, case.model, case.inputs, STEPS, LR, ptd=ptd)
    assert_trains_like_torch(run)


def _serialized_tensor_data(program, tmp=None):
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as folder:
        program.write_tensor_data_to_file(folder)
        files = sorted(Path(folder).glob("*.ptd"))
        return [f.read_bytes() for f in files]


def test_audio1d_fully_trainable_trains(qnn_sdk):
    """1-D: executorch's CanonicalizeConv bakes a copy of a 1-D weight; the plugin reads
    the trainable parameter instead, and dilates the grouped, dilated node's run-time
    filter in the graph."""
    graph = models.audio1d_graph(trainable_backbone=True)
    result = qnn_convbwd.lower(graph.program, harness.compile_specs(SOC))
    assert all(r.delegated for r in result.report.rows), result.report.to_markdown()
    assert harness.delegate_count(result.edge) == 1
    run = training.train_side_by_side(
        result.edge.to_executorch().buffer, graph.model, graph.inputs, STEPS, LR
    )
    assert_trains_like_torch(run)


def test_cross_entropy_to_executorch_without_convolution(qnn_sdk):
    """int64 constants of the loss (ignore_index) kept on CPU keep their dtype."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 10))
    case = models.TrainingCase(
        "linear-ce",
        models.CrossEntropyTraining(net),
        (torch.randn(4, 3, 4, 4), torch.randint(0, 10, (4,))),
    )
    result, _ = lower(case)
    run = training.train_side_by_side(
        result.edge.to_executorch().buffer, case.model, case.inputs, 3, LR
    )
    assert_trains_like_torch(run)


def test_stock_executorch_flow_after_enable_trains(qnn_sdk):
    """The user's own ExecuTorch code after ``enable()`` (QnnPassManager passes,
    ``to_edge_transform_and_lower`` with ``QnnPartitioner``) gives a program that
    TrainingModule trains, as ``qnn_convbwd.lower`` does."""
    from executorch.backends.qualcomm._passes.qnn_pass_manager import QnnPassManager
    from executorch.backends.qualcomm.partition.qnn_partitioner import QnnPartitioner
    from executorch.backends.qualcomm.utils.utils import qnn_edge_config
    from executorch.exir import to_edge_transform_and_lower

    case = models.adapter_case("demo", trainable=True)
    specs = harness.compile_specs(SOC)
    with qnn_convbwd.enabled():
        manager = QnnPassManager()
        program = manager.transform_for_export_pipeline(case.joint())
        edge = to_edge_transform_and_lower(
            program,
            transform_passes=manager.get_to_edge_transform_passes(program, compiler_specs=specs),
            partitioner=[QnnPartitioner(specs)],
            compile_config=qnn_edge_config(),
        )
        pte = edge.to_executorch().buffer
    assert harness.delegate_count(edge) == 1
    run = training.train_side_by_side(pte, case.model, case.inputs, 3, LR)
    assert_trains_like_torch(run)
