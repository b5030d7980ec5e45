"""Stopping work: a run on SIGINT or SIGTERM, and a stage (rollout function, reward) past its time limit.

The CLI's handlers raise in the main thread so that the run unwinds (engines, Ray and workers shut down).
A signal that arrives while the main thread runs a weakref callback or a ``__del__`` has its exception
dropped ("Exception ignored in ...", printed with a traceback), and the run would go on. So the handler also
records the signal, the loops call :func:`check` once per step, which raises again what was dropped, and
Python's report of the dropped interruption is left out (it is not an error: the run stops as asked).

Coroutines the main thread runs go through :func:`run`: there a signal cancels the coroutine's task instead
of raising inside whatever the loop was doing (a subprocess being spawned, the selector), so every
``finally`` of the rollouts runs on a sound loop, and the interruption is raised once the task has unwound.
A second signal while it unwinds raises at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, TypeVar

__all__ = ["Terminated", "handling", "check", "run", "interruption", "TimedOut", "with_time_limit", "time_limit",
           "within", "failure_reason"]

T = TypeVar("T")


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that the run unwinds like Ctrl-C (engines, Ray shut down)."""


_pending: int | None = None


def _raise(signum: int) -> None:
    raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt


def interruption(exc: BaseException) -> KeyboardInterrupt | None:
    """The interruption (Ctrl-C, SIGTERM) that ``exc`` is, or that it was raised while handling; None when neither.

    A signal raises wherever the main thread is: inside ``threading.Condition.wait`` (a future's ``result``) it
    can land between the lock's release and its re-acquisition, and the ``with`` around the wait then fails with
    "RuntimeError: cannot release un-acquired lock" in place of the interruption. The run was still interrupted."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return exc
        seen.add(id(exc))
        exc = exc.__context__  # type: ignore[assignment]
    return None


def _on_signal(signum: int, frame: object) -> None:
    global _pending
    _pending = signum
    _raise(signum)


def _unraisable(report: Any) -> None:
    """Python's report of an exception it had to drop: silent for an interruption of ours (recorded, and raised
    again by :func:`check` or :func:`run`), the default report for anything else."""
    if isinstance(report.exc_value, KeyboardInterrupt) and _pending is not None:
        return
    sys.__unraisablehook__(report)


@contextlib.contextmanager
def handling() -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM raise in this (main) thread (KeyboardInterrupt, :class:`Terminated`)
    and coroutines run through :func:`run` are cancelled by them. After it, the handlers and the unraisable
    hook are what they were, and nothing is left pending: the process (a notebook, a test session) can run
    again without an interruption of the last run landing in the next."""
    global _pending
    saved = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), sys.unraisablehook
    _pending = None
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    sys.unraisablehook = _unraisable
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, saved[0])
        signal.signal(signal.SIGTERM, saved[1])
        sys.unraisablehook = saved[2]
        _pending = None


def check() -> None:
    """Raise the interruption of a signal whose exception was swallowed (a no-op after none, and once only)."""
    global _pending
    if _pending is not None:
        signum, _pending = _pending, None
        _raise(signum)


def run(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coro)``, where SIGINT/SIGTERM (within :func:`handling`) cancel the coroutine and the
    interruption is raised after it has unwound. Elsewhere (another thread, no handler) plain ``asyncio.run``.

    The loop takes the signals itself (``add_signal_handler``: the signal wakes its selector whichever thread
    the kernel delivered it to, and the callback runs between two callbacks of the loop, never inside one)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is not _on_signal:
        return asyncio.run(coro)
    with asyncio.Runner() as runner:
        loop = runner.get_loop()
        task = loop.create_task(coro)

        def on_signal(signum: int) -> None:
            global _pending
            if _pending is not None or task.done():  # a second signal, or one after the work: raise now
                _pending = signum
                _raise(signum)
            _pending = signum
            task.cancel()

        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, on_signal, signum)
        try:
            result = loop.run_until_complete(task)
        except asyncio.CancelledError:
            check()  # cancelled by a signal: raise its interruption instead
            raise
        finally:
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(signum)
                signal.signal(signum, _on_signal)
        check()  # the task finished in spite of the cancel
        return result


class TimedOut(Exception):
    """A user function ran past its configured time limit."""


def with_time_limit(fn: Callable, timeout_s: float) -> Callable:
    """``fn``, marked to run under a limit of ``timeout_s`` seconds (0: none) by the rollout and reward
    stages. The mark is on a new wrapper (``.func`` is ``fn``), never on ``fn`` itself."""
    limited = functools.partial(fn)
    limited.miles_timeout_s = float(timeout_s)  # type: ignore[attr-defined]
    return limited


def time_limit(fn: Callable) -> float | None:
    """The limit :func:`with_time_limit` put on ``fn``, in seconds; None for no limit."""
    return getattr(fn, "miles_timeout_s", 0.0) or None


def failure_reason(stage: str, exc: Exception) -> str:
    """Why a sample failed: ``stage: timed out after N s``, or ``stage: ErrorType: message``."""
    return f"{stage}: {exc}" if isinstance(exc, TimedOut) else f"{stage}: {type(exc).__name__}: {exc}"


async def within(timeout_s: float | None, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable``; past ``timeout_s`` seconds (None: no limit) it is cancelled and TimedOut raised.
    A TimeoutError that the awaitable raises itself passes through unchanged."""
    limit = asyncio.timeout(timeout_s)
    try:
        async with limit:
            return await awaitable
    except TimeoutError:
        if limit.expired():
            raise TimedOut(f"timed out after {timeout_s:g} s") from None
        raise
