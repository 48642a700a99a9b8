"""Per-QNN-op cycles of one training step on the x86-64 HTP simulator, from ETDump.

Lowers a model of ``models.TRAINING_MODELS`` with executorch's QNN profiling
(``generate_qnn_executorch_compiler_spec(profile_level=2)``, kProfileDetailed),
runs ``forward`` ``--runs`` times with ``Runtime.load_program(enable_etdump=True)``
and prints the cycles the QNN profiler reports per op and run. See
docs/cost.md for what these numbers are worth on the simulator.

    python scripts/op_cycles.py --model demo --runs 3
    python scripts/op_cycles.py --model demo --stride phases
    python scripts/op_cycles.py --zoo resnet18 bias_only --runs 3 --summary
    python scripts/op_cycles.py --conv 256x256x3 --input-gradient transpose_conv --runs 5

``--zoo ARCH SCHEME`` profiles ``qnn_convbwd_dev.zoo.graph(ARCH, SCHEME, --size)`` instead;
``--conv CONFIG`` one frozen convolution and its grad_input (``qnn_convbwd_dev.weight_bytes``'
``fwd+bwd`` program; CONFIG as in scripts/weight_bytes.py). ``--summary`` adds the
cycles per kind of op (``op_kind``) and run.
"""

from __future__ import annotations

import argparse
import re
import tempfile
from collections import defaultdict
from pathlib import Path

from qnn_convbwd import api, options
from qnn_convbwd.toolchain import ensure_sdk
from qnn_convbwd_dev import models, weight_bytes

_ATEN = re.compile(r"aten_(.+?)_(?:default|tensor|scalar|int|dim|self|intlist)(?:_|$|:)", re.I)


def op_kind(name: str) -> str:
    """The aten op a QNN op is named after (``aten_convolution_backward_default_2_gb`` ->
    ``convolution_backward``), else the name without its ``:OpId_<n>`` and numbers."""
    match = _ATEN.search(name)
    if match:
        return match.group(1)
    return re.sub(r"[_:]?(OpId_)?\d+", "", name.split(":")[0]) or name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(models.TRAINING_MODELS), default="demo")
    parser.add_argument("--trainable", action="store_true")
    parser.add_argument(
        "--zoo", nargs=2, metavar=("ARCH", "SCHEME"), help="qnn_convbwd_dev.zoo.graph"
    )
    parser.add_argument("--size", type=int, default=32, help="input size of --zoo")
    parser.add_argument("--conv", metavar="CONFIG", help="one frozen conv, fwd+bwd")
    parser.add_argument("--summary", action="store_true", help="cycles per kind of op too")
    parser.add_argument("--soc", default="SM8650")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--level", type=int, default=2, choices=(2, 3), help="2 detailed, 3 optrace"
    )
    parser.add_argument(
        "--stride", choices=options.STRIDE_MODES, default=None, help="Options.stride"
    )
    parser.add_argument(
        "--input-gradient",
        choices=options.INPUT_GRADIENT_FORMULATIONS,
        default=None,
        help="Options.input_gradient",
    )
    args = parser.parse_args()

    ensure_sdk()
    from executorch.backends.qualcomm.serialization.qc_schema import QcomChipset
    from executorch.backends.qualcomm.utils.utils import (
        generate_htp_compiler_spec,
        generate_qnn_executorch_compiler_spec,
    )
    from executorch.devtools.etdump.serialize import deserialize_from_etdump_flatcc
    from executorch.runtime import Runtime

    specs = generate_qnn_executorch_compiler_spec(
        getattr(QcomChipset, args.soc),
        generate_htp_compiler_spec(use_fp16=True),
        profile_level=args.level,
    )
    if args.zoo:
        from qnn_convbwd_dev import zoo

        graph = zoo.graph(*args.zoo, args.size)
        title, joint, inputs = graph.name, graph.program, graph.inputs
    elif args.conv:
        config = weight_bytes.ConvConfig.parse(args.conv)
        _, inputs, joint = weight_bytes.export(config, "fwd+bwd")
        title = f"{config} fwd+bwd"
    else:
        case = models.TRAINING_MODELS[args.model](args.trainable)
        title, joint, inputs = case.name, case.joint(), case.inputs
    chosen = {"stride": args.stride, "input_gradient": args.input_gradient}
    with api.enabled(**{k: v for k, v in chosen.items() if v}):
        pte = api.lower(joint, specs).edge.to_executorch().buffer
    program = Runtime.get().load_program(pte, enable_etdump=True, debug_buffer_size=int(1e7))
    method = program.load_method("forward")
    for _ in range(args.runs):
        method.execute(list(inputs))
    with tempfile.TemporaryDirectory() as tmp:
        etdump, debug = Path(tmp, "run.etdp"), Path(tmp, "debug.bin")
        program.write_etdump_result_to_file(str(etdump), str(debug))
        dump = deserialize_from_etdump_flatcc(etdump.read_bytes())
    runs: list[dict[str, int]] = []
    for run in dump.run_data:
        events = {}
        for event in run.events or []:
            profile = event.profile_event
            # QNN's events carry their name in delegate_debug_id_str
            name = profile and (profile.name or profile.delegate_debug_id_str)
            if name:
                events[name] = profile.end_time - profile.start_time
        if any(name.endswith("(cycles)") for name in events):
            runs.append(events)
    names = [n for n in runs[0] if n.endswith("(cycles)")] if runs else []
    print(f"{title} on {args.soc}, profile level {args.level}: cycles per run")
    for event in names:
        print(
            f"{event[: -len(' (cycles)')]:<70}" + "".join(f"{r.get(event, 0):>12,}" for r in runs)
        )
    if args.summary:
        kinds: dict[str, list[int]] = defaultdict(lambda: [0] * len(runs))
        counts: dict[str, int] = defaultdict(int)
        for event in names:
            if "OpId_" not in event:  # totals (accelerator, QNN execute), not an op
                continue
            kind = op_kind(event)
            counts[kind] += 1
            for i, r in enumerate(runs):
                kinds[kind][i] += r.get(event, 0)
        print("| op kind | ops | " + " | ".join(f"run {i + 1}" for i in range(len(runs))) + " |")
        print("|---|---|" + "---|" * len(runs))
        for kind, cycles in sorted(kinds.items(), key=lambda kv: -kv[1][-1]):
            print(f"| {kind} | {counts[kind]} | " + " | ".join(f"{c:,}" for c in cycles) + " |")


if __name__ == "__main__":
    main()
