"""A router in front of N engines that speak SGLang's protocol.

Least-outstanding-requests routing, periodic health checks, quarantine after repeated failures,
retry of a failed request on another engine, and re-admission (after an optional catch-up, e.g.
pushing the current weights) when a quarantined engine answers again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from miles.errors import RunError

__all__ = ["EngineEndpoint", "Router", "EngineRequestError", "NoHealthyEngine"]


class EngineRequestError(ValueError):
    """The engine refused the request (HTTP 400): the request is wrong, retrying will not help."""


class NoHealthyEngine(RunError):
    pass


@dataclass(eq=False)
class EngineEndpoint:
    url: str
    outstanding: int = 0
    failures: int = 0  # consecutive
    quarantined: bool = False
    weight_version: int = -1
    resolve: Callable[[], Awaitable[str]] | None = None  # a fresh URL after a restart (Ray actors)
    served: int = 0
    meta: dict[str, Any] = field(default_factory=dict)


class Router:
    def __init__(self, urls: list[str] = (), *, health_interval_s: float = 1.0, max_failures: int = 3,
                 max_retries: int = 3, request_timeout_s: float = 600.0, admin_token: str = "",
                 on_readmit: Callable[[EngineEndpoint], Awaitable[None]] | None = None) -> None:
        self.engines = [EngineEndpoint(url.rstrip("/")) for url in urls]
        self.health_interval_s = health_interval_s
        self.max_failures = max_failures
        self.max_retries = max_retries
        self.request_timeout_s = request_timeout_s
        self.on_readmit = on_readmit
        self.headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self.stats = {"engine_failures": 0, "retries": 0, "readmissions": 0}
        self._session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task | None = None
        self._changed = asyncio.Event()

    # -- lifecycle ----------------------------------------------------------------------------------

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.request_timeout_s))
        self._changed = asyncio.Event()
        self._health_task = asyncio.create_task(self._health_loop())

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
        self._session = self._health_task = None

    async def __aenter__(self) -> "Router":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def healthy(self) -> list[EngineEndpoint]:
        return [e for e in self.engines if not e.quarantined]

    # -- requests -----------------------------------------------------------------------------------

    async def post(self, engine: EngineEndpoint, path: str, body: dict[str, Any] | bytes, timeout_s: float | None = None,
                   params: dict[str, str] | None = None) -> Any:
        """POST JSON (a dict) or raw bytes (``application/octet-stream``) to one engine."""
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s else None
        if isinstance(body, bytes):
            kwargs: dict[str, Any] = {"data": body, "headers": {**self.headers, "Content-Type": "application/octet-stream"}}
        else:
            kwargs = {"json": body, "headers": self.headers}
        async with self._session.post(engine.url + path, timeout=timeout, params=params, **kwargs) as resp:
            payload = await resp.json(content_type=None)
            if resp.status == 400:
                raise EngineRequestError(payload.get("error", str(payload)))
            if resp.status != 200:
                raise RuntimeError(f"{engine.url}{path} answered HTTP {resp.status}: {payload}")
            if isinstance(payload, dict) and isinstance(payload.get("weight_version"), int):
                engine.weight_version = payload["weight_version"]  # weight updates answer with the new version
            return payload

    def _pick(self) -> EngineEndpoint | None:
        healthy = self.healthy
        return min(healthy, key=lambda e: (e.outstanding, e.served)) if healthy else None

    async def _wait_for_engine(self, deadline: float) -> EngineEndpoint:
        while (engine := self._pick()) is None:
            if time.monotonic() > deadline:
                raise NoHealthyEngine(f"no healthy engine among {len(self.engines)} within {self.request_timeout_s} s")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=min(1.0, max(0.01, deadline - time.monotonic())))
            except asyncio.TimeoutError:
                pass
        return engine

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any] | None = None,
                       return_logprob: bool = True, rid: str | None = None) -> dict[str, Any]:
        """Route one request; on a connection error or a dead engine, retry on another."""
        body = {"input_ids": input_ids, "sampling_params": sampling_params or {}, "return_logprob": return_logprob}
        if rid is not None:
            body["rid"] = rid
        deadline = time.monotonic() + self.request_timeout_s
        last_error: Exception | None = None
        for attempt in range(self.max_retries + 1):
            engine = await self._wait_for_engine(deadline)
            engine.outstanding += 1
            try:
                answer = await self.post(engine, "/generate", body)
            except EngineRequestError:
                raise
            except Exception as exc:  # connection refused or reset, engine died mid-request
                last_error = exc
                self._mark_failed(engine, exc)
                if attempt < self.max_retries:
                    self.stats["retries"] += 1
                continue
            finally:
                engine.outstanding -= 1
            engine.served += 1
            engine.failures = 0
            engine.weight_version = answer["meta_info"].get("weight_version", engine.weight_version)
            return answer
        raise NoHealthyEngine(f"request failed on {self.max_retries + 1} attempts; last error: {last_error}")

    def _mark_failed(self, engine: EngineEndpoint, error: Exception) -> None:
        engine.failures += 1
        if not engine.quarantined:
            # A request that breaks mid-flight is strong evidence: quarantine at once, let health checks re-admit.
            engine.quarantined = True
            engine.meta["last_error"] = f"{type(error).__name__}: {error}"
            self.stats["engine_failures"] += 1
            self._changed.set()

    # -- health -------------------------------------------------------------------------------------

    async def check(self, engine: EngineEndpoint) -> bool:
        try:
            if engine.quarantined and engine.resolve is not None:
                engine.url = (await engine.resolve()).rstrip("/")
            async with self._session.get(engine.url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                ok = resp.status == 200
                if ok:
                    engine.weight_version = (await resp.json()).get("weight_version", engine.weight_version)
        except Exception:
            ok = False
        if not ok:
            engine.failures += 1
            if engine.failures >= self.max_failures and not engine.quarantined:
                engine.quarantined = True
                self.stats["engine_failures"] += 1
                self._changed.set()
            return False
        engine.failures = 0
        if engine.quarantined:
            if self.on_readmit is not None:
                await self.on_readmit(engine)
            engine.quarantined = False
            self.stats["readmissions"] += 1
            self._changed.set()
        return True

    async def _health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self.check(e) for e in self.engines), return_exceptions=True)
            await asyncio.sleep(self.health_interval_s)

    async def abort(self) -> int:
        """Abort every request in flight on every healthy engine (they answer with what they have)."""
        answers = await asyncio.gather(*(self.post(e, "/abort_request", {"abort_all": True}) for e in self.healthy),
                                       return_exceptions=True)
        return sum(a.get("aborted", 0) for a in answers if isinstance(a, dict))

    async def wait_healthy(self, count: int | None = None, timeout_s: float = 60.0) -> None:
        """Wait until ``count`` engines (default all) answer their health check, else raise."""
        count = len(self.engines) if count is None else count
        deadline = time.monotonic() + timeout_s
        while True:
            results = await asyncio.gather(*(self.check(e) for e in self.engines))
            if sum(results) >= count:
                return
            if time.monotonic() > deadline:
                down = [e.url for e, ok in zip(self.engines, results) if not ok]
                raise NoHealthyEngine(f"engines never became healthy within {timeout_s} s: {', '.join(down)}")
            await asyncio.sleep(0.2)
