#!/usr/bin/env python3
"""Run a training graph on an Android device's HTP and compare with torch and with CPU.

Builds two programs from the same joint forward-backward graph (the demo graph
by default): one lowered with qnn_convbwd (HTP) and one without any partitioner
(executorch's portable CPU kernels). Pushes them with executorch's
qnn_executor_runner and the QNN runtime libraries of the SoC's HTP architecture,
runs both over adb, pulls the outputs and prints the error against torch
autograd and the HTP vs CPU latency.

    export QNN_SDK_ROOT=/opt/qcom/aistack/qairt/2.51.0.260929
    python scripts/run_on_device.py --soc SM8850 --build-dir ~/executorch/build-android
    python scripts/run_on_device.py --soc SM8850 --runner ./qnn_executor_runner --dry-run

Exit codes: 0 success, 1 device run failed or outputs off, 2 a prerequisite is missing.
A dry run needs none of them: it prints the plan, marks what is missing and exits 0.

``train`` trains a ``qnn-convbwd finetune --out RUN`` folder's train.pte (its optimizer
inside the program) on the device, one batch of --data per step, through a runner
with the command-line contract of ``qnn_convbwd.device_train`` (executorch 1.5.1
ships none that fits), and pulls back the trained weights, the program's state and
the losses:

    python scripts/run_on_device.py train --run RUN --data DATA --steps 100 \
        --runner ./qnn_train_runner --out device_train

Exit codes: 0 success, 1 the device run failed or wrote malformed outputs, 2 a
missing or unreadable artifact or prerequisite (nothing pushed or written then).
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from pathlib import Path

from qnn_convbwd import device


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--soc", required=True, help="target SoC, e.g. SM8850")
    parser.add_argument(
        "--qnn-sdk",
        default=os.environ.get("QNN_SDK_ROOT"),
        help="QAIRT SDK with the device libraries (default: $QNN_SDK_ROOT)",
    )
    parser.add_argument("--runner", help="path of qnn_executor_runner (aarch64-android)")
    parser.add_argument(
        "--build-dir",
        default=os.environ.get("EXECUTORCH_BUILD_DIR"),
        help="executorch Android build dir to find the runner and backend library in "
        "(default: $EXECUTORCH_BUILD_DIR)",
    )
    parser.add_argument("--backend-lib", help="path of libqnn_executorch_backend.so")
    parser.add_argument("--adb", help="adb executable (default: adb on PATH)")
    parser.add_argument("-s", "--serial", help="device serial (adb -s)")
    parser.add_argument("-H", "--adb-host", help="adb server host (adb -H)")
    parser.add_argument("--workspace", default=device.DEFAULT_WORKSPACE, help="device directory")
    parser.add_argument("--out", type=Path, default=Path("device_run"), help="host directory")
    parser.add_argument("--backbone", default="demo", help="qnn_convbwd_dev.models backbone")
    parser.add_argument("--size", type=int, default=15, help="input height and width")
    parser.add_argument("--channels", type=int, default=8)
    parser.add_argument("--trainable-backbone", action="store_true")
    parser.add_argument("--iterations", type=int, default=20, help="executions per program")
    parser.add_argument("--atol", type=float, default=1e-2, help="max abs error accepted")
    parser.add_argument(
        "--dry-run", action="store_true", help="print files and commands; build and run nothing"
    )
    parser.add_argument(
        "--build-only", action="store_true", help="build the programs and inputs, no adb"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    return parser.parse_args(argv)


def parse_train_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="run_on_device.py train",
        description="Train a finetune run's train.pte on a device and pull the weights back.",
    )
    parser.add_argument("--run", type=Path, required=True, help="a finetune --out folder")
    parser.add_argument(
        "--data",
        type=Path,
        required=True,
        help="training data as finetune --data reads it (a folder of class folders, or a "
        ".pt/.npz file with x and y); normalised as the run's report.json says",
    )
    parser.add_argument("--steps", type=int, help="training steps (default: one pass)")
    parser.add_argument(
        "--runner", type=Path, required=True, help="the device-side training runner binary"
    )
    parser.add_argument(
        "--qnn-sdk",
        default=os.environ.get("QNN_SDK_ROOT"),
        help="QAIRT SDK whose device libraries are pushed when train.pte has QNN delegates",
    )
    parser.add_argument(
        "--backend-lib", type=Path, help="libqnn_executorch_backend.so, pushed when given"
    )
    parser.add_argument("--adb", help="adb executable (default: adb on PATH)")
    parser.add_argument("-s", "--serial", help="device serial (adb -s)")
    parser.add_argument("-H", "--adb-host", help="adb server host (adb -H)")
    parser.add_argument(
        "--workspace", default=device.DEFAULT_WORKSPACE + "_train", help="device directory"
    )
    parser.add_argument("--out", type=Path, default=Path("device_train"), help="host folder")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    return parser.parse_args(argv)


def train(argv: list[str]) -> int:
    from qnn_convbwd import device_train, finetune_data

    args = parse_train_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        run = device_train.load_run(args.run)
        data = device_train.batches(run, args.data, args.steps)
        if not args.runner.is_file():
            raise device.SetupError(f"--runner {args.runner}: no such file")
        libraries = [args.backend_lib] if args.backend_lib else []
        if run.delegates:
            arch = device.soc_arch(run.report["soc"])
            libraries = device.device_libraries(device.resolve_sdk(args.qnn_sdk, arch), arch)
            libraries += [args.backend_lib] if args.backend_lib else []
        for library in libraries:
            if not library.is_file():
                raise device.SetupError(f"{library}: no such file")
        plan = device_train.Plan(
            run,
            args.runner,
            args.out,
            len(data),
            args.workspace,
            device.resolve_adb(args.adb),
            args.serial,
            args.adb_host,
            tuple(libraries),
        )
    except (
        device_train.ArtifactError,
        finetune_data.DataError,
        device.SetupError,
    ) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    device_train.write_inputs(plan, data)
    print(
        f"training {run.pte} on the device: {plan.steps} steps of batch "
        f"{len(data[0][1])}, {run.report['optimizer']['name']} in the program"
    )
    try:
        device_train.execute(plan)
        results = device_train.read_results(plan)
    except device.DeviceError as err:
        print(f"error: device run failed: {err}", file=sys.stderr)
        return 1
    written = device_train.save_results(
        results, args.out, {"steps": plan.steps, "run": str(args.run), "data": str(args.data)}
    )
    print(f"losses: first {results.losses[0]:.6f}, last {results.losses[-1]:.6f}")
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:
        return train(argv[1:])
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    offline = args.dry_run or args.build_only
    try:
        setup = device.check_setup(
            args.soc,
            args.qnn_sdk,
            runner=args.runner,
            build_dir=args.build_dir,
            backend_lib=args.backend_lib,
            adb=args.adb,
            need_adb=not offline,
            dry_run=args.dry_run,
        )
    except device.SetupError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    from qnn_convbwd_dev.models import training_graph

    graph = training_graph(
        args.backbone,
        size=args.size,
        channels=args.channels,
        trainable_backbone=args.trainable_backbone,
    )
    plan = device.Plan(
        setup,
        args.out,
        num_inputs=len(graph.inputs),
        iterations=args.iterations,
        workspace=args.workspace,
        serial=args.serial,
        adb_host=args.adb_host,
    )
    shapes = ", ".join(str(tuple(t.shape)) for t in graph.inputs)
    print(f"graph: {graph.name}, inputs {shapes}, {len(graph.reference())} outputs")
    if args.dry_run:
        print("dry run: nothing is built, pushed or run")
        written = [*map(plan.pte, device.PROGRAMS), *plan.input_files, plan.input_list]
        print("would write:", ", ".join(map(str, written)))
        for line in plan.describe():
            print(line)
        if setup.missing:
            print("missing (a run stops here with exit code 2):")
            for reason in setup.missing:
                print(f"  {reason}")
        return 0

    built = device.build(graph, plan)
    print(
        f"built {plan.pte('htp')} ({built.htp_partitions} QNN partitions, lowered in "
        f"{built.htp_seconds:.1f} s) and {plan.pte('cpu')} (CPU only)"
    )
    from qnn_convbwd.toolchain import active_sdk

    host, target = active_sdk(), device.sdk_build_id(setup.sdk)
    if host is not None and target is not None and host.build_id != target:
        print(
            f"warning: the HTP program was compiled with QAIRT {host.build_id} but the device "
            f"libraries are QAIRT {target}; QNN may reject the context binary",
            file=sys.stderr,
        )
    if args.build_only:
        return 0

    try:
        runs = device.execute(plan, built.reference)
    except device.DeviceError as err:
        print(f"error: device run failed: {err}", file=sys.stderr)
        return 1
    by_name = {r.program: r for r in runs}
    print(f"\n| program | latency (ms, avg of {args.iterations}) | max abs err vs torch |")
    print("|---|---|---|")
    for r in runs:
        latency = "n/a" if r.latency_ms is None else f"{r.latency_ms:.3f}"
        print(f"| {r.program} | {latency} | {r.max_abs_error:.2e} |")
    htp, cpu = by_name["htp"].latency_ms, by_name["cpu"].latency_ms
    if htp and cpu:
        print(f"\nHTP vs CPU-only: {cpu / htp:.2f}x ({htp:.3f} ms vs {cpu:.3f} ms)")
    bad = [r for r in runs if r.max_abs_error > args.atol]
    for r in bad:
        print(
            f"error: {r.program} outputs differ from torch by {r.max_abs_error:.2e} "
            f"> --atol {args.atol}",
            file=sys.stderr,
        )
    print("commands were:", *(shlex.join(c) for c in plan.commands()), sep="\n  ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
