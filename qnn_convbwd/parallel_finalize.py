"""A program's delegates built and finalised in parallel, each in a forked process.

QAIRT finalises one QNN graph on one core, and executorch hands the QNN backend
every delegate of a program at once (``QnnBackend.preprocess_multimethod``: per
method, the list of its partitions), then compiles them one after another. Here
each partition is preprocessed in a child process forked from the lowering, up to
``finalize_workers`` at a time. A fork shares the lowering's memory as it stands:
the child runs executorch's own preprocess on its one partition and sends back
what it returns (the context binary) and the builders' fallbacks it recorded
(``judge.record_fallback``). The parent puts the results in the partitions' order,
as executorch's loop would.

Everything runs in this process, one delegate after another, when:

* there is one partition, or one worker (``finalize_workers=1``, or this process
  may use one core);
* the platform cannot fork;
* the target is the Saver (executorch ends the process once it has recorded);
* intermediate outputs are dumped (their debug handles accumulate across the
  partitions);
* something in this process wraps the build to observe it
  (``integration.capture_qnn_graphs``, ``qnn_convbwd_dev.lowering_time``): what it
  records in a child would be lost;
* this process is such a child already.

A child that raises makes the lowering raise: its own exception where it can be
sent back, else a ``RuntimeError`` carrying its traceback, naming the delegate.
A child that ends without a result (killed, out of memory) has its partition
preprocessed again in this process, after the others.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from . import options, progress
from .partition import judge

logger = logging.getLogger(__name__)

_POLL_SECONDS = 0.2
_in_child = False


def available_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# The default bound on processes at once: each holds a QAIRT finalisation, which takes
# up to a few GB on a large graph (docs/results.md, peak memory of a lowering).
DEFAULT_WORKERS = 4


def workers() -> int:
    """How many delegates are finalised at once: ``finalize_workers``, else the cores
    this process may use, at most ``DEFAULT_WORKERS``."""
    return options.current.finalize_workers or min(available_cores(), DEFAULT_WORKERS)


def _why_in_process(partitions: int, compile_specs: list, build_observed: bool) -> str:
    """Why these partitions are preprocessed in this process ("" when they need not be)."""
    if partitions < 2:
        return "one delegate"
    if workers() < 2:
        return "one worker"
    if not hasattr(os, "fork"):
        return "no fork on this platform"
    if _in_child:
        return "already in a child"
    if build_observed:
        return "the build is observed in this process"
    return _why_target_in_process(compile_specs)


def _why_target_in_process(compile_specs: list) -> str:
    from .partition.target import Target

    if Target.from_compile_specs(compile_specs).saver:
        return "the Saver records in process"
    from . import integration

    option = integration.get("flatbuffer_to_option")(
        integration.get("generate_qnn_executorch_option")(compile_specs)
    )
    if option.dump_intermediate_outputs:
        return "intermediate outputs are dumped"
    return ""


def preprocess(
    original: Callable[[dict, dict], dict],
    edge_programs: dict[str, list],
    compile_specs: dict[str, list[list]],
    *,
    build_observed: bool = False,
) -> dict[str, list]:
    """executorch's ``preprocess_multimethod``, its partitions spread over processes.

    ``original(edge_programs, compile_specs)`` is executorch's own; the result is
    what it returns: per method, one ``PreprocessResult`` per partition, in order.
    """
    methods = list(edge_programs)
    count = len(edge_programs[methods[0]]) if methods else 0
    first_specs = compile_specs[methods[0]][0] if methods else []
    why = _why_in_process(count, first_specs, build_observed)
    if why or any(len(edge_programs[m]) != count for m in methods):
        if count > 1:
            logger.info("finalising %d delegates in process: %s", count, why or "uneven methods")
        return original(edge_programs, compile_specs)
    return _in_children(original, edge_programs, compile_specs, methods, count)


def _one(edge_programs: dict, compile_specs: dict, methods: list[str], index: int) -> tuple:
    return (
        {m: [edge_programs[m][index]] for m in methods},
        {m: [compile_specs[m][index]] for m in methods},
    )


def _in_children(
    original: Callable[[dict, dict], dict],
    edge_programs: dict,
    compile_specs: dict,
    methods: list[str],
    count: int,
) -> dict[str, list]:
    width = min(workers(), count)
    logger.info("finalising %d delegates, %d at a time in forked processes", count, width)
    results: list[dict | None] = [None] * count
    fallbacks: list[list] = [[] for _ in range(count)]
    retry: list[int] = []
    pending = list(range(count))
    running: dict[int, tuple[int, Path]] = {}
    done = 0
    progress.parallel_finalize(done, count)
    with tempfile.TemporaryDirectory(prefix="qnn_convbwd_finalize_") as scratch:
        try:
            while pending or running:
                while pending and len(running) < width:
                    index = pending.pop(0)
                    path = Path(scratch) / f"{index}.pickle"
                    running[_fork(original, edge_programs, compile_specs, methods, index, path)] = (
                        index,
                        path,
                    )
                finished = _reap(running)
                if not finished:
                    time.sleep(_POLL_SECONDS)
                    continue
                for index, path, status in finished:
                    outcome = _read(path)
                    if outcome is None:
                        logger.warning(
                            "delegate %d/%d: its process ended (%s) without a result; "
                            "finalising it in this process",
                            index + 1,
                            count,
                            _describe(status),
                        )
                        retry.append(index)
                        continue
                    if "error" in outcome:
                        _raise(outcome, index, count)
                    results[index] = outcome["result"]
                    fallbacks[index] = outcome["fallbacks"]
                    done += 1
                    progress.parallel_finalize(done, count)
        finally:
            _stop(running)
    for index in retry:
        one = original(*_one(edge_programs, compile_specs, methods, index))
        results[index] = {m: one[m][0] for m in methods}
        done += 1
        progress.parallel_finalize(done, count)
    for recorded in fallbacks:
        judge.merge_fallbacks(recorded)
    return {m: [result[m] for result in results] for m in methods}  # type: ignore[index]


def _fork(
    original: Callable[[dict, dict], dict],
    edge_programs: dict,
    compile_specs: dict,
    methods: list[str],
    index: int,
    path: Path,
) -> int:
    pid = os.fork()
    if pid:
        return pid
    # The child: never returns into the parent's code.
    code = 1
    try:
        _become_child()
        before = judge.fallback_keys()
        one = original(*_one(edge_programs, compile_specs, methods, index))
        outcome = {
            "result": {m: one[m][0] for m in methods},
            "fallbacks": judge.fallbacks_since(before),
        }
        code = 0
    except BaseException as error:  # sent to the parent, which raises it
        outcome = {"error": _sendable(error), "traceback": traceback.format_exc()}
    try:
        data = pickle.dumps(outcome)
        partial = path.with_suffix(".partial")
        partial.write_bytes(data)
        partial.rename(path)
    except BaseException:
        code = 2
    finally:
        os._exit(code)


def _become_child() -> None:
    global _in_child
    _in_child = True
    progress.detach()
    with contextlib.suppress(Exception):
        import torch

        torch.set_num_threads(1)  # the parent's thread pool is not in the child


def _sendable(error: BaseException) -> BaseException | None:
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return None
    return error


def _reap(running: dict[int, tuple[int, Path]]) -> list[tuple[int, Path, int]]:
    finished = []
    for pid in list(running):
        done_pid, status = os.waitpid(pid, os.WNOHANG)
        if done_pid:
            index, path = running.pop(pid)
            finished.append((index, path, status))
    return finished


def _read(path: Path) -> dict | None:
    try:
        return pickle.loads(path.read_bytes())
    except (OSError, pickle.UnpicklingError, EOFError):
        return None


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}"
    return f"exit status {os.waitstatus_to_exitcode(status)}"


def _raise(outcome: dict, index: int, count: int) -> None:
    where = f"delegate {index + 1}/{count}, finalised in a forked process"
    error = outcome["error"]
    if error is not None:
        error.add_note(f"qnn_convbwd: raised in {where}:\n{outcome['traceback']}")
        raise error
    raise RuntimeError(f"{where} failed:\n{outcome['traceback']}")


def _stop(running: dict[int, tuple[int, Path]]) -> None:
    """Children still running when the parent gives up (an error, an interrupt)."""
    for pid in running:
        with contextlib.suppress(OSError):
            os.kill(pid, 9)
        with contextlib.suppress(OSError):
            os.waitpid(pid, 0)
    running.clear()
