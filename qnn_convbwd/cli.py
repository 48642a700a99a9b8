"""``qnn-convbwd`` command line: doctor, demo, bench."""

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
    "demo": ("qnn_convbwd.demo", "lower and run a frozen-backbone training graph"),
    "bench": ("qnn_convbwd.bench", "benchmark training graphs with and without the plugin"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qnn-convbwd", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        modules[name] = module
        module.add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    return int(modules[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
