"""Stopping a run on SIGINT or SIGTERM, even when the signal lands where Python swallows exceptions.

The CLI's handlers raise in the main thread so that the run unwinds (engines, Ray and workers shut down).
A signal that arrives while the main thread runs a weakref callback or a ``__del__`` has its exception
printed and dropped ("Exception ignored in ..."), and the run would go on. So the handler also records the
signal, and the loops call :func:`check` once per step: it raises again what was dropped.
"""

from __future__ import annotations

import signal

__all__ = ["Terminated", "handle", "check"]


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that the run unwinds like Ctrl-C (engines, Ray shut down)."""


_pending: int | None = None


def _raise(signum: int) -> None:
    raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt


def _on_signal(signum: int, frame: object) -> None:
    global _pending
    _pending = signum
    _raise(signum)


def handle() -> None:
    """Take SIGINT and SIGTERM in this (main) thread from now on."""
    global _pending
    _pending = None
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)


def check() -> None:
    """Raise the interruption of a signal whose exception was swallowed (a no-op after none, and once only)."""
    global _pending
    if _pending is not None:
        signum, _pending = _pending, None
        _raise(signum)
