"""Progress of a lowering: which phase, which delegate, how long since it started.

The plugin's hooks report each phase here (``phase``); every report is logged at
INFO and handed to the observers registered with ``observe``. The library prints
nothing: the CLI renders the events as a progress line on a terminal.

Phases, in order: ``export passes`` (the program's passes before partitioning),
``partition``, then per delegate ``QNN graph build`` and either ``finalize``
(QAIRT compiles the context binary) or ``cache hit`` (``context_cache``). Where
the delegates are finalised in forked processes (``parallel_finalize``), one
``finalize in parallel`` event per delegate done takes the per-delegate phases'
place.

Besides the phases, the package's long calls (lowering, a simulator run, training
side by side, a Saver recording, a probe in a child process) are marked with
``long_call``: observers registered with ``observe_calls`` hear when each starts
and ends, and what it is doing.

A lowering through ``qnn_convbwd.lower`` is one run (``run``); the stock flow
(``to_edge_transform_and_lower`` after ``enable()``) starts a run when executorch
calls the partitioner's pre-decomposition transform, and that run ends after its
last delegate.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

EXPORT = "export passes"
PARTITION = "partition"
BUILD = "QNN graph build"
FINALIZE = "finalize"
CACHE_HIT = "cache hit"
PARALLEL = "finalize in parallel"  # parallel_finalize: delegates built in forked processes
DONE = "done"


@dataclasses.dataclass(frozen=True)
class Event:
    phase: str
    elapsed: float  # seconds since the lowering started
    delegate: int | None = None  # 1-based, for the per-delegate phases
    delegates: int | None = None  # known once partitioning is done

    def describe(self) -> str:
        if self.phase == PARALLEL:
            return f"{self.phase}: {self.delegate}/{self.delegates} done ({self.elapsed:.1f} s)"
        where = ""
        if self.delegate is not None:
            where = f"delegate {self.delegate}/{self.delegates or '?'}: "
        return f"{where}{self.phase} ({self.elapsed:.1f} s)"


@dataclasses.dataclass
class _Run:
    start: float
    owned: bool  # started by run(), ended by it
    delegate: int = 0
    delegates: int | None = None


_lock = threading.Lock()
_observers: list[Callable[[Event], None]] = []
# Called with (what the call is doing, True when it starts / False when it ends).
_call_observers: list[Callable[[str, bool], None]] = []

F = TypeVar("F", bound=Callable[..., Any])
_current: _Run | None = None


@contextlib.contextmanager
def observe(callback: Callable[[Event], None]) -> Iterator[None]:
    """Call ``callback(event)`` for every progress event while the block runs."""
    with _lock:
        _observers.append(callback)
    try:
        yield
    finally:
        with _lock:
            _observers.remove(callback)


@contextlib.contextmanager
def run() -> Iterator[None]:
    """One lowering: events inside the block count their time from its start."""
    global _current
    with _lock:
        outer = _current
        if outer is None or not outer.owned:
            _current = _Run(time.perf_counter(), owned=True)
    try:
        yield
    finally:
        if outer is None or not outer.owned:
            _emit(DONE)
            with _lock:
                _current = None


def begin_implicit() -> None:
    """The stock flow started a lowering (a no-op inside ``run``)."""
    global _current
    with _lock:
        if _current is None or not _current.owned:
            _current = _Run(time.perf_counter(), owned=False)
    _emit(EXPORT)


def phase(name: str, *, new_delegate: bool = False) -> None:
    """Report that ``name`` starts (``new_delegate``: for the next delegate)."""
    global _current
    with _lock:
        if _current is None:
            _current = _Run(time.perf_counter(), owned=False)
        if new_delegate:
            _current.delegate += 1
    _emit(name)


def partitioned(delegates: int) -> None:
    """Partitioning made ``delegates`` delegates (shown as ``k/n`` from now on)."""
    with _lock:
        if _current is not None:
            _current.delegates = delegates


def delegate_done() -> None:
    """A delegate's context binary is ready; ends a stock-flow run after its last one."""
    global _current
    with _lock:
        run_ = _current
        last = run_ is not None and run_.delegates is not None and run_.delegate >= run_.delegates
        if run_ is None or run_.owned or not last:
            return
    _emit(DONE)
    with _lock:
        if _current is run_:
            _current = None


def parallel_finalize(done: int, delegates: int) -> None:
    """``done`` of ``delegates`` finalised in forked processes; the last one ends a
    stock-flow run."""
    global _current
    with _lock:
        if _current is None:
            _current = _Run(time.perf_counter(), owned=False)
        _current.delegate = done
        _current.delegates = delegates
    _emit(PARALLEL)
    if done == delegates:
        delegate_done()


def detach() -> None:
    """In a forked child: report nothing (the parent reports), and take a fresh lock
    (another thread of the parent may have held this one at the fork)."""
    global _lock, _current
    _lock = threading.Lock()
    _observers.clear()
    _call_observers.clear()
    _current = None


def _emit(name: str) -> None:
    with _lock:
        run_ = _current
        observers = list(_observers)
    if run_ is None:
        return
    per_delegate = name in (BUILD, FINALIZE, CACHE_HIT, PARALLEL)
    event = Event(
        phase=name,
        elapsed=time.perf_counter() - run_.start,
        delegate=run_.delegate if per_delegate else None,
        delegates=run_.delegates,
    )
    logger.info("lowering: %s", event.describe())
    for callback in observers:
        try:
            callback(event)
        except Exception:  # an observer must not break the lowering
            logger.exception("progress observer %r failed", callback)


@contextlib.contextmanager
def observe_calls(callback: Callable[[str, bool], None]) -> Iterator[None]:
    """Call ``callback(what, True)`` when a ``long_call`` starts and ``callback(what,
    False)`` when it ends (also on an exception), while the block runs."""
    with _lock:
        _call_observers.append(callback)
    try:
        yield
    finally:
        with _lock:
            _call_observers.remove(callback)


def long_call(what: str) -> Callable[[F], F]:
    """Mark a function as a long call doing ``what`` (e.g. "lowering") for the
    ``observe_calls`` observers; with none registered it costs one list read."""

    def mark(function: F) -> F:
        @functools.wraps(function)
        def marked(*args: Any, **kwargs: Any) -> Any:
            with _lock:
                observers = list(_call_observers)
            if not observers:
                return function(*args, **kwargs)
            _tell(observers, what, True)
            try:
                return function(*args, **kwargs)
            finally:
                _tell(observers, what, False)

        return marked  # type: ignore[return-value]

    return mark


def _tell(observers: list[Callable[[str, bool], None]], what: str, started: bool) -> None:
    for callback in observers:
        try:
            callback(what, started)
        except Exception:  # an observer must not break the call
            logger.exception("long-call observer %r failed", callback)
