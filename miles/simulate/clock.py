"""An asyncio event loop on a simulated clock: time stands still while callbacks run and jumps to the next timer
when nothing is ready, so a day of ``asyncio.sleep`` runs in as long as its callbacks take.

Everything asyncio times (``sleep``, ``wait_for``, ``call_later``, timeouts) follows :meth:`VirtualLoop.time`.
Nothing may wait on real I/O: a loop with nothing ready and no timer left has deadlocked, and says so
(:class:`Stalled`) rather than sleeping forever.
"""

from __future__ import annotations

import asyncio
import selectors
from typing import Any

__all__ = ["Stalled", "VirtualLoop"]


class Stalled(RuntimeError):
    """Nothing is ready and nothing is scheduled: every task waits on something that will never happen."""


class _JumpingSelector(selectors.SelectSelector):
    """Polls the loop's own wake-up pipe without blocking; where the loop would block until its next timer, the
    clock jumps there instead."""

    def __init__(self, loop: VirtualLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise Stalled(f"the simulation stalled at t={self._loop.now:.3f} s: no task can go on and no timer is set")
        self._loop.now += timeout
        return []


class VirtualLoop(asyncio.SelectorEventLoop):
    """``now`` (seconds, from 0) is the simulated time."""

    def __init__(self) -> None:
        self.now = 0.0
        super().__init__(selector=_JumpingSelector(self))

    def time(self) -> float:
        return self.now

    def run(self, coro: Any) -> Any:
        """Run ``coro`` to completion on the simulated clock (what the rollout plane's ``run`` does)."""
        return self.run_until_complete(coro)
