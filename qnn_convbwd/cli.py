"""``qnn-convbwd`` command line: doctor, demo, bench, fidelity."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# subcommand -> (module with add_arguments(parser) and run(args) -> int, help)
COMMANDS = {
    "doctor": (
        "qnn_convbwd.toolchain.doctor",
        "report the QNN SDK, the shim and which backends work",
    ),
    "demo": ("qnn_convbwd.demo", "train a small CNN on the HTP simulator next to torch"),
    "train": ("qnn_convbwd.train_cli", "train a model with TrainingModule + SGD next to torch"),
    "bench": ("qnn_convbwd.bench", "benchmark training graphs with and without the plugin"),
    "fidelity": (
        "qnn_convbwd.fidelity_cli",
        "run a training graph on the simulator and judge it against torch's fp16 step",
    ),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qnn-convbwd", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    broken: dict[str, str] = {}
    for name, (module_name, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:  # one broken subcommand must not take the others down
            broken[name] = f"{module_name}: {err}"
            continue
        modules[name] = module
        module.add_arguments(command)
    args = parser.parse_args(argv)
    if args.command in broken:
        print(f"qnn-convbwd {args.command}: cannot load {broken[args.command]}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    return int(modules[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
