"""torchvision's model zoo as joint training graphs, for the tests and the scripts.

torchvision is imported with ``qnn_convbwd.torchvision_import.import_torchvision``
(its C ops do not load on this project's CPU torch; that module says why).
"""

from __future__ import annotations

import torch

from qnn_convbwd.torchvision_import import (  # noqa: F401  (re-exported)
    TorchvisionUnavailable,
    import_torchvision,
)

ARCHITECTURES = (
    "resnet18",
    "mobilenet_v2",
    "mobilenet_v3_small",
    "efficientnet_b0",
    "squeezenet1_1",
    "shufflenet_v2_x0_5",
)
SCHEMES = ("bias_only", "last_layers", "full", "adapter")


def train_mode_batch(
    arch: str, scheme: str, batch: int, size: int, seed: int, dropout: bool = False
) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A classifier of ``qnn_convbwd.finetune`` in ``train()`` with its ``scheme``
    (finetune's names: ``bias-only``, ...) applied, and one seeded batch of random
    images and labels. Dropout modules are put in ``eval()`` unless ``dropout``: the
    program and torch draw different masks."""
    from qnn_convbwd import finetune

    net = finetune.architecture(arch, classes=10, seed=seed).train()
    net = finetune.apply_scheme(net, scheme, size=size)
    if not dropout:
        for module in net.modules():
            if isinstance(module, torch.nn.modules.dropout._DropoutNd):
                module.eval()
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, size, size, generator=generator)
    y = torch.randint(0, 10, (batch,), generator=generator)
    return net, x, y


class Finetune(torch.nn.Module):
    """``net`` (after ``adapter`` when given) with an MSE loss against a target.

    What the joint graph trains.
    """

    def __init__(self, net: torch.nn.Module, adapter: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.adapter = adapter
        self.net = net

    def forward(self, x, target):
        if self.adapter is not None:
            x = self.adapter(x)
        return torch.nn.functional.mse_loss(self.net(x), target)


def last_layers(net: torch.nn.Module) -> tuple[str, ...]:
    """Name prefixes of the last stage and the head of a torchvision classifier.

    The last block of ``features`` (or of the last ``layerN`` / ``stageN``, or
    ``conv5`` of ShuffleNet) plus ``classifier`` / ``fc``: what "fine-tune the
    last layers" means for these architectures.
    """
    children = dict(net.named_children())
    head = next(name for name in ("fc", "classifier") if name in children)
    if "layer4" in children:  # ResNet
        return ("layer4.", f"{head}.")
    if "conv5" in children:  # ShuffleNetV2
        return ("stage4.", "conv5.", f"{head}.")
    features = children["features"]
    last = len(features) - 1
    while not any(p.requires_grad for p in features[last].parameters()):
        last -= 1  # SqueezeNet's features end with parameter-free pools/ReLUs
    return (f"features.{last}.", f"{head}.")


def head(net: torch.nn.Module) -> str:
    """Name prefix of the last ``nn.Linear`` of a torchvision classifier (its head)."""
    last = [name for name, m in net.named_modules() if isinstance(m, torch.nn.Linear)][-1]
    return f"{last}."


def trainable(net: torch.nn.Module, scheme: str) -> list[str]:
    """Names of the parameters of ``net`` that ``scheme`` trains.

    * ``bias_only``: every bias (batch-norm biases included), the TinyTL recipe;
    * ``last_layers``: the last stage and the head (``last_layers``);
    * ``full``: every parameter;
    * ``adapter``: only the head (``head``: the last ``nn.Linear``); ``graph``
      adds a trainable 1x1 adapter in front of ``net``. The backbone, every
      convolution and batch norm, weights and biases, is frozen: the
      personalisation recipe of a frozen feature extractor with a small trained
      input adapter and classifier. The adapter's gradient flows back through
      every frozen convolution, so each does its grad_input (and none its
      grad_weight).
    """
    names = [name for name, _ in net.named_parameters()]
    if scheme == "adapter":
        return [name for name in names if name.startswith(head(net))]
    if scheme == "bias_only":
        return [name for name in names if name.endswith("bias")]
    if scheme == "last_layers":
        prefixes = last_layers(net)
        return [name for name in names if name.startswith(prefixes)]
    if scheme == "full":
        return names
    raise ValueError(f"scheme {scheme!r}: one of {SCHEMES}")


def calibrated(arch: str, size: int = 32, classes: int = 10, seed: int = 0) -> torch.nn.Module:
    """torchvision's ``arch`` with random weights (``seed``) and batch-norm statistics, eval().

    The statistics are the plain average (momentum None) of 3 train-mode passes
    over random ``size`` x ``size`` batches of 4, with torch's CPU kernels pinned
    (``reference_kernels.pinned``): executorch's QNN lowering turns oneDNN off for the
    process on an AMD host, and statistics computed after a lowering were other numbers.
    """
    from . import reference_kernels

    torchvision = import_torchvision()
    torch.manual_seed(seed)
    net = getattr(torchvision.models, arch)(num_classes=classes)
    for module in net.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.momentum = None
            module.reset_running_stats()
    net.train()
    with torch.no_grad(), reference_kernels.pinned():
        for _ in range(3):
            net(torch.randn(4, 3, size, size))
    return net.eval()


def graph(arch: str, scheme: str = "bias_only", size: int = 32, classes: int = 10, seed: int = 0):
    """``models.TrainingGraph`` of torchvision's ``arch`` fine-tuned by ``scheme``, MSE.

    Random weights (``seed``); batch-norm statistics are the plain average
    (momentum None) of 3 train-mode passes over random batches of 4, then eval();
    the parameters ``trainable(net, scheme)`` names train, the others are frozen;
    scheme ``adapter`` puts a trainable 1x1 convolution close to the identity
    (``models.identity_adapter``, 3 channels) in front of ``net``.
    Batch 1, ``size`` x ``size`` input.
    """
    from torch.export.experimental import _export_forward_backward

    from . import models

    model, inputs = step(arch, scheme, size, classes, seed)
    joint = _export_forward_backward(torch.export.export(model, inputs, strict=True))
    return models.TrainingGraph(f"{arch}/{scheme}", model, inputs, joint)


def step(arch: str, scheme: str = "bias_only", size: int = 32, classes: int = 10, seed: int = 0):
    """``graph``'s model (returning the loss) and input, not exported: for eager probes."""
    from . import models

    net = calibrated(arch, size, classes, seed)
    train = set(trainable(net, scheme))
    for name, parameter in net.named_parameters():
        parameter.requires_grad_(name in train)
    adapter = None
    if scheme == "adapter":
        adapter = models.identity_adapter(3, torch.Generator().manual_seed(seed))
    model = Finetune(net, adapter)
    return model, (torch.randn(1, 3, size, size), torch.randn(1, classes))


def bias_only(arch: str, size: int = 32, classes: int = 10, seed: int = 0):
    """``graph(arch, "bias_only", ...)``: every bias trains (the TinyTL recipe)."""
    return graph(arch, "bias_only", size, classes, seed)


def more_inputs(graph, count: int) -> list[tuple[torch.Tensor, ...]]:
    """``count`` inputs of ``graph``'s shapes: standard normal, seeds 1000, 1001, ..."""
    out = []
    for i in range(count):
        generator = torch.Generator().manual_seed(1000 + i)
        out.append(tuple(torch.randn(t.shape, generator=generator) for t in graph.inputs))
    return out


def reports(graph, compiled, count: int = 1, first=None, around: bool = False) -> list:
    """``fidelity.assess_model`` of ``compiled`` on the graph's input and ``count - 1``
    ``more_inputs`` (``first``: the outputs on the graph's input, when already run);
    with ``around``, ``count - 1`` ``fidelity.neighbours`` of the input instead."""
    from . import fidelity

    if around:
        inputs = fidelity.neighbours(graph.inputs, count)
    else:
        inputs = [graph.inputs, *more_inputs(graph, count - 1)]
    found = []
    for i, args in enumerate(inputs):
        outputs = first if i == 0 and first is not None else compiled.run(list(args))
        outputs = joint_outputs(graph, outputs)
        found.append(fidelity.assess_model(graph.model, args, graph.program, outputs))
    return found


def joint_outputs(graph, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The joint graph's outputs (loss, gradients) of a training program's ``forward``.

    ``to_executorch()`` of a joint graph appends the trained parameters to the
    outputs (ExecuTorch's training runtime reads them from there); checked to be
    the parameters' values, then dropped.
    """
    from . import fidelity

    names = fidelity.output_names(graph.program)
    trained = [n for n in names if n != "loss"]
    params = dict(graph.model.named_parameters())
    tail = outputs[len(names) :]
    if len(tail) != len(trained) or not all(
        torch.equal(t, params[n].detach()) for t, n in zip(tail, trained)
    ):
        raise RuntimeError(f"{len(outputs)} outputs: not {len(names)} + the trained parameters")
    return outputs[: len(names)]


def gate_matched(graph, soc: str, count: int, first: list[torch.Tensor]) -> list:
    """``gate_match.assess`` of ``graph`` on its input and ``count - 1`` fp16 neighbours
    (``reports(..., around=True)``'s draws), each side judged on its own gate decisions.

    The joint program is lowered again (for ``soc``, with the options in effect)
    with every gate's compared tensor as an extra output
    (``gate_match.with_gate_outputs``). ``first`` are the plain lowering's outputs
    on the graph's input: the gated lowering's own outputs must equal them bit for
    bit, or this raises (its gates would then be another computation's).
    """
    from qnn_convbwd.toolchain import harness

    from . import fidelity, gate_match

    gated = gate_match.with_gate_outputs(graph.program, graph.model, graph.inputs)
    compiled = harness.lower_program(gated.program, soc)
    found = []
    for i, args in enumerate(fidelity.neighbours(graph.inputs, count)):
        own, sides = gated.split(compiled.run(list(args)))
        if i == 0:
            differ = [k for k, (a, b) in enumerate(zip(own, first)) if not torch.equal(a, b)]
            if differ or len(own) != len(first):
                raise RuntimeError(
                    f"{graph.name}: the gated lowering's outputs {differ[:5]} differ from the "
                    "plain lowering's: its gate tensors are not the plain program's"
                )
        found.append(
            gate_match.assess(graph.model, args, graph.program, joint_outputs(graph, own), sides)
        )
    return found


def judges(reports: list, around: bool = False) -> list[tuple[str, object]]:
    """docs/zoo.md's verdicts on one graph's ``reports`` (the input's first), as
    ``(label, fidelity.Report)``.

    One report: ``"the input"``. Several: ``"pooled"`` (``fidelity.pooled``, rms);
    over the input's fp16 neighbours (``around``, as ``reports`` made them) also
    ``"medians"`` and ``"the input alone"``; the graph is within when the two
    poolings are (the input alone is one draw of the fp16 noise).
    """
    from . import fidelity

    if len(reports) == 1:
        return [("the input", reports[0])]
    verdicts = [("pooled", fidelity.pooled(reports))]
    if around:
        median = fidelity.pooled(reports, how="median")
        verdicts += [("medians", median), ("the input alone", reports[0])]
    return verdicts


def causes(arch: str, scheme: str, size: int, verdicts: list[tuple[str, object]]):
    """Why each verdict outside the bound is outside: ``(summaries, flips, [(label, causes)])``.

    ``kinks.find`` on ``step(arch, scheme, size)`` (CPU, torch fp32 and fp16; the
    gate summaries and every flip computed), then ``kinks.explain`` of each verdict
    outside: every tensor outside and the single gate flips behind it. All three are
    empty when every verdict is within (nothing is run).
    """
    from . import kinks

    outside = [(label, report) for label, report in verdicts if not report.within]
    if not outside:
        return [], [], []
    model, inputs = step(arch, scheme, size)
    summaries, flips = kinks.find(model, inputs, top=None)
    return summaries, flips, [(label, kinks.explain(report, flips)) for label, report in outside]


def parse_options(pairs: list[str]) -> dict[str, object]:
    """``["a=b", "loss_scale=256.0", "htp_optimization=2"]`` as
    ``{"a": "b", "loss_scale": 256.0, "htp_optimization": 2}`` (``qnn_convbwd.Options``
    fields given on a script's command line)."""
    out: dict[str, object] = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        for parse in (int, float, str):
            try:
                out[name] = parse(value)
                break
            except ValueError:
                continue
    return out
