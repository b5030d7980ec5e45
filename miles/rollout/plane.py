"""The rollout plane as the loop sees it: an event loop of its own, the engines, and how to reach them.

Local: one in-process :class:`LocalEngine`. Remote: N engines served over HTTP (Ray actors, or
any SGLang-compatible servers) behind a :class:`Router`. Either way rollout functions call
``plane.client.generate(...)``, and weight transports reach engines through the plane (it is a
:class:`miles.weights.fleet.Engines`, its router a :class:`~miles.weights.fleet.Fleet`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import aiohttp

from miles import interrupts
from miles.engine.router import Router

__all__ = ["EventLoopThread", "RolloutPlane"]

T = TypeVar("T")


class EventLoopThread:
    """An asyncio loop running in a daemon thread; ``run`` executes a coroutine there and waits."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="miles-rollout", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except BaseException:  # an interruption or the time limit: the coroutine stops too, its finally blocks run
            future.cancel()
            raise

    def close(self) -> None:
        if self.loop.is_running():
            async def cancel_pending() -> None:
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

            try:
                self.run(cancel_pending(), timeout_s=10)
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self._thread.join(timeout=10)
        self.loop.close()


class RolloutPlane:
    def __init__(self, *, local_engines: list[Any] = (), router: Router | None = None, threaded: bool = False) -> None:
        """``threaded``: in-process engines get a loop of their own too, for rollouts that go on between calls
        (the one_step_off and async schedules)."""
        self.local_engines = list(local_engines)
        self.router = router
        self.fleet: Any = None  # engines on Ray: a miles.engine.ray_fleet.RayFleet, which grows and shrinks
        self.aio: EventLoopThread | None = None  # the router's session and health checks live on it
        if router is not None or threaded:
            self.aio = EventLoopThread()
        if router is not None:
            self.aio.run(router.start())

    @property
    def remote(self) -> bool:
        return self.router is not None

    @property
    def client(self) -> Any:
        """What rollout functions call ``generate`` on."""
        return self.router if self.router is not None else self.local_engines[0]

    @property
    def weight_version(self) -> int:
        if self.router is None:
            return self.local_engines[0].weight_version
        return max(e.weight_version for e in self.router.engines)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        if self.aio is None:  # nothing lives on the loop between steps: run in this thread, one thread fewer
            return interrupts.run(coro)
        return self.aio.run(coro, timeout_s)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the plane's loop without waiting for it."""
        return asyncio.run_coroutine_threadsafe(coro, self.aio.loop)

    def post_all(self, path: str, body: dict[str, Any] | bytes, timeout_s: float | None = None,
                 params: dict[str, str] | None = None) -> list[Any]:
        """POST to every engine in service and return the answers of those that took it; one that fails
        is quarantined and catches up when it returns (:meth:`Router.post_all`)."""
        return self.run(self.router.post_all(path, body, timeout_s, params))

    def release_memory(self) -> None:
        """Engines give their memory back while a colocated trainer trains (SGLang: weights, KV cache, CUDA graphs;
        ``rollout.engine.release_memory_during_train``)."""
        self.post_all("/release_memory_occupation", {"tags": None})

    def resume_memory(self, *tags: str) -> None:
        """Engines take back the memory of ``tags`` (``weights`` before a push, then ``kv_cache`` and
        ``cuda_graph``)."""
        self.post_all("/resume_memory_occupation", {"tags": list(tags)})

    def prefill_counts(self) -> tuple[int, ...]:
        """The engines' counts of :data:`ENGINE_COUNTS`, summed over the engines since each started: prompt tokens
        they admitted and those they ran through the model (the difference came from their prefix caches), then
        their speculative steps' (:data:`miles.engine.speculative_step.SPEC_STATS`). Remote engines report theirs in
        ``/server_info``; one that does not answer (or reports none) counts 0 this time."""
        return self.prefill_counts_soon()()

    def prefill_counts_soon(self) -> Callable[[], tuple[int, ...]]:
        """:meth:`prefill_counts`, asked now and read when the returned function is called: remote engines answer
        on the plane's loop meanwhile (a trainer asks before its step and reads after it)."""
        if self.router is None:
            counts = _prefill_sums([engine.stats() if hasattr(engine, "stats") else {}
                                    for engine in self.local_engines])
            return lambda: counts

        async def fetch() -> list[dict[str, Any]]:
            async def one(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
                try:
                    async with session.get(url + "/server_info", headers=self.router.headers) as resp:
                        return (await resp.json())["internal_states"][0] if resp.status == 200 else {}
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, IndexError, TypeError):
                    return {}

            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
                return await asyncio.gather(*(one(session, e.url) for e in self.router.engines if not e.down))

        future = asyncio.run_coroutine_threadsafe(fetch(), self.aio.loop)
        return lambda: _prefill_sums(future.result())

    def close(self) -> None:
        if self.aio is not None:
            if self.router is not None:
                self.aio.run(self.router.close())
            self.aio.close()
        for engine in self.local_engines:
            close = getattr(engine, "close", None)
            if close is not None:
                close()


ENGINE_COUNTS = ("prefill_tokens_requested", "prefill_tokens_computed", "spec_row_forwards", "spec_proposed",
                 "spec_accepted", "spec_tokens")


def _prefill_sums(states: list[Any]) -> tuple[int, ...]:
    states = [s for s in states if isinstance(s, dict)]
    return tuple(sum(int(s.get(name, 0)) for s in states) for name in ENGINE_COUNTS)
