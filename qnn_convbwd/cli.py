"""``qnn-convbwd`` command line: doctor, demo, train, finetune, bench, fidelity, cost, profile,
cache."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys
import threading
from collections.abc import Iterator
from typing import IO, Any

from . import logs

# The developer subcommands (bench, fidelity, cost, profile) live in this package, shipped beside
# qnn_convbwd in the repository but never imported by it.
DEV_PACKAGE = "qnn_convbwd_dev"

# subcommand -> (module with add_arguments(parser) and run(args) -> int, help)
COMMANDS = {
    "doctor": (
        "qnn_convbwd.toolchain.doctor",
        "report the QNN SDK, the shim and which backends work",
    ),
    "demo": ("qnn_convbwd.commands.demo", "train a small CNN on the HTP simulator next to torch"),
    "train": (
        "qnn_convbwd.commands.train_cli",
        "train a model with TrainingModule + SGD next to torch",
    ),
    "finetune": (
        "qnn_convbwd.commands.finetune_cli",
        "fine-tune a classifier on your images or scikit-learn's digits, next to torch",
    ),
    "bench": ("qnn_convbwd_dev.bench", "benchmark training graphs with and without the plugin"),
    "fidelity": (
        "qnn_convbwd_dev.fidelity_cli",
        "run a training graph on the simulator and judge it against torch's fp16 step",
    ),
    "cost": (
        "qnn_convbwd_dev.cost",
        "multiply-adds, bytes and planned memory of a lowered training program",
    ),
    "profile": (
        "qnn_convbwd_dev.profile",
        "a training step's CPU ops, delegate calls and optimizer from ETDump, NPU beside CPU",
    ),
    "cache": (
        "qnn_convbwd.commands.cache_cli",
        "list or clear the cache of context binaries and lowerings",
    ),
}


def _pre_parse(argv: list[str]) -> argparse.Namespace:
    """The options that matter before any subcommand module is imported."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("-v", "--verbose", action="store_true")
    pre.add_argument("--no-progress", action="store_true")
    return pre.parse_known_args(argv)[0]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    early = _pre_parse(argv)
    logging.basicConfig(
        level=logging.INFO if early.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    # Progress only on a terminal, decided before the output is redirected.
    progress = not early.no_progress and sys.stdout.isatty() and sys.stderr.isatty()
    if early.verbose:
        os.environ["QNN_CONVBWD_QNN_LOG"] = "all"  # the HTP shim keeps every QNN message
        return _main(argv, None)
    logs.quiet_libraries()
    with logs.filtered_native_output() as originals:
        terminal = os.fdopen(os.dup(originals[2]), "w") if progress and 2 in originals else None
        try:
            return _main(argv, terminal)
        finally:
            if terminal is not None:
                terminal.close()


def _main(argv: list[str], terminal: IO[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="qnn-convbwd", description=__doc__)
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="log at INFO level and show executorch's and QNN's own output",
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bars (off unless on a terminal)"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = next((a for a in argv if a in COMMANDS), None)
    module = None
    for name, (module_name, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        if name != chosen:
            continue
        # Only the subcommand that runs is imported: a broken or missing one (the
        # developer tools are a separate package) does not take the others down.
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            parser.parse_known_args(argv)  # --help as usual
            print(f"qnn-convbwd {name}: {_cannot_load(module_name, err)}", file=sys.stderr)
            return 2
        module.add_arguments(command)
    args = parser.parse_args(argv)
    assert module is not None, args.command
    with _progress(terminal):
        return int(module.run(args) or 0)


def _cannot_load(module_name: str, err: ImportError) -> str:
    if module_name.startswith(f"{DEV_PACKAGE}.") and _missing(err, DEV_PACKAGE):
        return (
            f"needs the developer tools ({DEV_PACKAGE}), which are not installed: "
            "from a checkout of the repository, pip install -e '.[dev]'"
        )
    if module_name.startswith(f"{DEV_PACKAGE}."):
        return (
            f"cannot load {module_name}: {err} (pip install -e '.[dev]' installs its dependencies)"
        )
    return f"cannot load {module_name}: {err}"


def _missing(err: ImportError, package: str) -> bool:
    """The import failed because ``package`` itself is absent (not one of its imports)."""
    name = getattr(err, "name", None) or ""
    return isinstance(err, ModuleNotFoundError) and (
        name == package or name.startswith(f"{package}.")
    )


@contextlib.contextmanager
def _progress(terminal: IO[str] | None) -> Iterator[None]:
    """Show a progress line with the elapsed time while one of the package's long calls
    runs (``progress.long_call``), with the lowering's phase (``progress.observe``)."""
    if terminal is None:
        yield
        return
    from tqdm import tqdm

    from . import progress

    depth = threading.local()  # nested long calls: the outermost line is showing
    shown: dict[str, Any] = {}

    def call(what: str, started: bool) -> None:
        level = getattr(depth, "value", 0)
        depth.value = level + 1 if started else level - 1
        if started and level == 0 and not shown:  # one line, for the first thread
            bar = tqdm(desc=what, file=terminal, leave=False, bar_format="{desc} ... {elapsed}")
            stop = threading.Event()

            def tick() -> None:
                while not stop.wait(0.5):
                    bar.refresh()

            ticker = threading.Thread(target=tick, daemon=True)
            ticker.start()
            shown.update(bar=bar, stop=stop, ticker=ticker, what=what, thread=threading.get_ident())
        elif not started and level == 1 and shown.get("thread") == threading.get_ident():
            shown["stop"].set()
            shown["ticker"].join()
            shown["bar"].close()
            shown.clear()

    def phase(event: Any) -> None:  # a lowering's phase
        if shown:
            shown["bar"].set_description_str(f"{shown['what']}: {event.describe().split(' (')[0]}")

    with progress.observe_calls(call), progress.observe(phase):
        yield


if __name__ == "__main__":
    sys.exit(main())
