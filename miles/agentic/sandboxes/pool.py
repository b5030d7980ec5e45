"""A pool of started sandboxes lent to trajectories and reused (``rollout.sandbox.pool: N``).

The pool keeps N sandboxes: started ahead of use (``await sandbox.start()``: the ``local`` sandbox with
``warm: true`` starts its interpreter), lent to one trajectory at a time, and, when the trajectory closes its
sandbox, reset (``await sandbox.reset()``) and lent to a later one. A trajectory gets a lease: the sandbox as it
is, but closing it gives it back to the pool, and the trajectory can do nothing more with it. The reset puts the
sandbox back as it started, so that nothing of one trajectory (files, processes, interpreter state, environment)
reaches the next, and verifies it; a sandbox whose reset fails, cannot be verified, or that hit a limit during
its trajectory is discarded (closed) and the pool starts another in its place. A sandbox without ``reset`` (or
that raises it: ``local`` in subprocess isolation, or without ``warm``) is never reused: it is closed when its
trajectory ends and replaced, as a fresh one would be.

When the pool has no sandbox ready (more trajectories at once than N), a trajectory gets a fresh sandbox, which
starts on first use and is closed with the trajectory: it never waits for the pool. A sandbox opened with options
of its own (``ctx.open_sandbox(mounts=...)``) is always a fresh one. The counts (:meth:`SandboxPool.metrics`)
say how the pool did: reused, discarded, started, and how often it was empty.

Starts run on the event loop of the trajectory that asked for them; one cut short when that loop ends (Miles runs
each sync step on a loop of its own) closes what it started, and the next take starts another. :meth:`aclose`
closes the idle sandboxes at the run's end; those lent are closed when their trajectories give them back, and
all of their processes end with Miles anyway (the sandbox's lifeline).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from statistics import quantiles
from typing import Any

__all__ = ["COUNTS", "SandboxPool"]

log = logging.getLogger(__name__)

# What the pool counts (sandbox/pool_<name> in a step's metrics): trajectories lent a sandbox that an earlier
# one used (reset since), sandboxes closed instead of reused (their reset failed or could not be verified, or
# they hit a limit), sandboxes started ahead, and trajectories that found the pool empty (a fresh sandbox).
COUNTS = ("reused", "discarded", "started", "empty")


class SandboxPool:
    """A sandbox factory (``pool(**options) -> sandbox``) that lends started sandboxes and reuses them; see the
    module."""

    def __init__(self, factory: Callable[..., Any], size: int) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"size: expected a whole number >= 1, got {size!r}")
        self.factory, self.size = factory, size
        self._idle: list[tuple[Any, bool]] = []  # ready for a trajectory, and whether one used it before
        self._starting: set[asyncio.Task] = set()
        self._owned = 0  # the pool's sandboxes: idle, starting, and lent
        self._closed = False
        self.counts = dict.fromkeys(COUNTS, 0)  # since the pool was made
        self._reported = dict.fromkeys(COUNTS, 0)
        self._reset_s: list[float] = []  # the resets since the last metrics()
        self.error: Exception | None = None  # why the last start failed

    def __call__(self, **options: Any) -> Any:
        """A sandbox for one trajectory: a lease on a ready one from the pool, else a fresh one."""
        if options or self._closed:
            return self.factory(**options)
        try:
            if not self._idle:
                self.counts["empty"] += 1
                return self.factory()
            sandbox, used = self._idle.pop(0)
            self.counts["reused"] += used
            if not callable(getattr(sandbox, "reset", None)) or not getattr(sandbox, "reusable", True):
                self._owned -= 1  # never comes back: closed with its trajectory
                return sandbox
            return _Lease(self, sandbox)
        finally:
            self._refill()

    async def fill(self) -> None:
        """Start sandboxes until the pool holds ``size`` (at the run's start; raises what a start raised)."""
        self.error = None
        self._refill()
        await asyncio.gather(*self._starting, return_exceptions=True)
        if self.error is not None:
            raise self.error

    def metrics(self) -> dict[str, float]:
        """The counts since the last call (``sandbox/pool_<count>``), and the resets' p50 and p99 in seconds."""
        report = {f"sandbox/pool_{name}": float(self.counts[name] - self._reported[name]) for name in COUNTS}
        self._reported = dict(self.counts)
        times, self._reset_s = sorted(self._reset_s), []
        if times:
            cuts = quantiles(times, n=100, method="inclusive") if len(times) > 1 else [times[0]] * 99
            report["sandbox/reset_s_p50"], report["sandbox/reset_s_p99"] = cuts[49], cuts[98]
        return report

    async def aclose(self) -> None:
        """Close the idle sandboxes and stop those starting (idempotent); later calls get fresh sandboxes."""
        self._closed = True
        starting, self._starting = list(self._starting), set()
        for task in starting:
            if task.get_loop() is asyncio.get_running_loop():
                task.cancel()
        await asyncio.gather(*(t for t in starting if t.get_loop() is asyncio.get_running_loop()),
                             return_exceptions=True)
        idle, self._idle = self._idle, []
        self._owned -= len(idle)
        await asyncio.gather(*(sandbox.close() for sandbox, _ in idle), return_exceptions=True)

    async def give_back(self, sandbox: Any) -> None:
        """A trajectory is done with ``sandbox`` (a lease's close): reset it for the next, or close it."""
        if not self._closed:
            started = time.perf_counter()
            try:
                await sandbox.reset()
            except Exception as exc:  # noqa: BLE001 - any failure to reset: never reuse it
                self.counts["discarded"] += 1
                log.info("rollout.sandbox.pool: a sandbox was closed, not reused: %s", exc)
            except BaseException:  # cut short: what it holds is not known
                await self._discard(sandbox)
                raise
            else:
                self._reset_s.append(time.perf_counter() - started)
                if not self._closed:
                    self._idle.append((sandbox, True))
                    return
        await self._discard(sandbox)

    async def _discard(self, sandbox: Any) -> None:
        self._owned -= 1
        await asyncio.shield(sandbox.close())
        if not self._closed:
            self._refill()

    def _refill(self) -> None:
        """Start as many sandboxes as the pool lacks, in the background on the running loop."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # called outside a loop: the next take refills
            return
        self._starting = {task for task in self._starting if not task.done()}
        for _ in range(self.size - self._owned):
            self._owned += 1
            task = loop.create_task(self._start_one())
            self._starting.add(task)

    async def _start_one(self) -> None:
        sandbox = self.factory()
        try:
            start = getattr(sandbox, "start", None)
            if start is not None:
                await start()
        except BaseException as exc:
            self._owned -= 1
            await asyncio.shield(sandbox.close())
            if not isinstance(exc, Exception):
                raise
            log.warning("rollout.sandbox.pool: a sandbox did not start: %s", exc)
            self.error = exc
            return
        if self._closed:
            self._owned -= 1
            await sandbox.close()
        else:
            self.counts["started"] += 1
            self._idle.append((sandbox, False))


class _Lease:
    """A pooled sandbox lent to one trajectory: the sandbox's methods and attributes, but :meth:`close` gives it
    back to the pool, and after that the lease is closed (as a closed sandbox is) whoever holds it next."""

    def __init__(self, pool: SandboxPool, sandbox: Any) -> None:
        self._pool, self._sandbox = pool, sandbox

    @property
    def lent(self) -> Any:
        """The sandbox lent (None once given back): the same object when the pool reuses it."""
        return self._sandbox

    def __getattr__(self, name: str) -> Any:
        sandbox = self.__dict__.get("_sandbox")
        if sandbox is None:
            raise RuntimeError("this sandbox is closed")
        return getattr(sandbox, name)

    async def close(self) -> None:
        sandbox, self._sandbox = self._sandbox, None
        if sandbox is not None:
            await self._pool.give_back(sandbox)
