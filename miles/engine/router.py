"""A router in front of N engines that speak SGLang's protocol.

Least-outstanding-requests routing, health checks, quarantine of an engine that fails, retry of a
failed request on another engine, and re-admission after a catch-up (``on_readmit``: the current
weights pushed) when a quarantined engine answers again.

Requests made in the same event-loop turn travel together (``batch_requests``): one batched
``/generate`` per engine (SGLang's list form of ``input_ids``), shared among the engines in service
by least outstanding requests. One HTTP round trip for a step's 128 small requests instead of 128 is
most of what separates engines in another process from one in this process. A batch that an engine
refuses (HTTP 400) is sent again one request at a time, so the refusal reaches the request it is about.

An engine's failure is one event however it shows (requests it breaks, a failed weight push, abort,
pause or catch-up, failed health checks): it is counted once in ``stats["engine_failures"]``, until
the engine answers a health check again. Only when no engine is left, every one quarantined and unable to come
back (``resolve`` raises :class:`EngineGone`), does a request or a post to all raise
:class:`NoHealthyEngine`.

A request waits for an engine in service at most until its deadline (``request_timeout_s``, retries included:
each attempt gets what is left of it). A router that cannot know whether an engine will come back (the
standalone ``miles router serve``, whose engines have no ``resolve``) sets ``no_engine_wait_s``: once every
engine is down (failed, and has not answered a health check since), a request waits that long after the last
one went down for one to answer again, then raises :class:`NoHealthyEngine` naming each engine and its last error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from miles.engine.endpoint import EngineEndpoint
from miles.errors import EngineRequestError, RunError

__all__ = ["EngineEndpoint", "Router", "EngineGone", "NoHealthyEngine", "NoEngineLeft"]

log = logging.getLogger(__name__)


class EngineGone(Exception):
    """Raised by an endpoint's ``resolve`` when the engine cannot come back (e.g. its Ray actor died for good)."""


class NoHealthyEngine(RunError):
    pass


class NoEngineLeft(NoHealthyEngine):
    """Every engine failed and none can come back: the run cannot go on (not one sample's failure)."""


# SGLang's /pause_generation aborts what is in flight unless told otherwise; Miles holds it (in place).
PAUSE_IN_PLACE = {"mode": "in_place"}


def _version(value: Any) -> int | None:
    """A weight version as an integer: SGLang sends strings ("7"), and "default" before any update."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None


def _error_text(payload: Any) -> str:
    """The reason in an engine's refusal: ``error`` (Miles), ``message`` (SGLang), else the whole answer."""
    if isinstance(payload, dict):
        for key in ("error", "message"):
            if isinstance(payload.get(key), str):
                return payload[key]
            if isinstance(payload.get(key), dict) and isinstance(payload[key].get("message"), str):
                return payload[key]["message"]
    return str(payload)


class Router:
    def __init__(self, urls: list[str] = (), *, health_interval_s: float = 1.0, max_failures: int = 3,
                 max_retries: int = 3, request_timeout_s: float = 600.0, admin_token: str = "",
                 on_readmit: Callable[[EngineEndpoint], Awaitable[None]] | None = None,
                 batch_requests: bool = True, no_engine_wait_s: float | None = None,
                 settings_as_flags: bool = False) -> None:
        """``no_engine_wait_s``: how long after every engine went down a request still waits for one (None: until
        its deadline); ``settings_as_flags``: errors name the settings as flags of ``miles router serve``
        (``--request-timeout-s``) rather than as config keys (``cluster.router.request_timeout_s``)."""
        self.engines = [EngineEndpoint(url.rstrip("/")) for url in urls]
        self.health_interval_s = health_interval_s
        self.max_failures = max_failures
        self.max_retries = max_retries
        self.request_timeout_s = request_timeout_s
        self.no_engine_wait_s = no_engine_wait_s
        self.settings_as_flags = settings_as_flags
        self.waiting_for_engine = 0  # requests waiting now for an engine in service
        self.on_readmit = on_readmit
        self.headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self.stats = {"engine_failures": 0, "retries": 0, "readmissions": 0, "engines_lost_with_node": 0}
        self.paused = False  # a re-admitted engine is paused too
        self.batch_requests = batch_requests
        self._batch: list[tuple[dict[str, Any], asyncio.Future]] = []  # this loop turn's requests
        self._sending: set[asyncio.Task] = set()  # batches on their way
        self._session: aiohttp.ClientSession | None = None
        self._health_tasks: list[asyncio.Task] = []
        self._changed = asyncio.Event()

    # -- lifecycle ----------------------------------------------------------------------------------

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.request_timeout_s))
        self._changed = asyncio.Event()
        self._health_tasks = [asyncio.create_task(self._watch(e)) for e in self.engines]

    async def close(self) -> None:
        tasks = [*self._health_tasks, *self._sending]  # what is still sent has nobody waiting for it any more
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
        self._session, self._health_tasks = None, []

    def add_engine(self, url: str, resolve: Callable[[], Awaitable[str]] | None = None) -> EngineEndpoint:
        """An engine joins the fleet: it serves once a health check finds it up and it has been caught up with the
        fleet's weights (``on_readmit``), like an engine back from a failure."""
        engine = EngineEndpoint(url.rstrip("/"), quarantined=True, down=True, resolve=resolve)
        self.engines.append(engine)
        if self._session is not None:  # started: watched like the others
            self._health_tasks.append(asyncio.create_task(self._watch(engine)))
        return engine

    async def remove_engine(self, engine: EngineEndpoint, *, drain: bool = True) -> None:
        """An engine leaves the fleet: no request goes to it from now on, and it is never re-admitted. With ``drain``
        the requests it holds finish there; without, they are aborted (answered with the tokens they have: a partial
        rollout continues them on another engine). Returns once it holds none."""
        engine.gone = engine.quarantined = True
        self._changed.set()
        if not drain and engine.outstanding:
            try:
                await self.post(engine, "/abort_request", {"abort_all": True})
            except Exception as exc:  # it failed meanwhile: its requests fail over to the others
                self._fail(engine, exc)
        while engine.outstanding:
            await asyncio.sleep(min(1.0, self.health_interval_s))

    async def __aenter__(self) -> "Router":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def healthy(self) -> list[EngineEndpoint]:
        """The engines in service."""
        return [e for e in self.engines if not e.quarantined]

    def name(self, engine: EngineEndpoint) -> str:
        return f"engine {self.engines.index(engine)} ({engine.url})"

    def setting(self, key: str) -> str:
        """Where a user sets ``key`` (``request_timeout_s``): a flag of ``miles router serve``, or the config key."""
        return f"--{key.replace('_', '-')}" if self.settings_as_flags else f"cluster.router.{key}"

    # -- requests -----------------------------------------------------------------------------------

    async def post(self, engine: EngineEndpoint, path: str, body: dict[str, Any] | bytes,
                   timeout_s: float | None = None, params: dict[str, str] | None = None) -> Any:
        """POST JSON (a dict) or raw bytes (``application/octet-stream``) to one engine."""
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s else None
        if isinstance(body, bytes):
            kwargs: dict[str, Any] = {"data": body,
                                      "headers": {**self.headers, "Content-Type": "application/octet-stream"}}
        else:
            kwargs = {"json": body, "headers": self.headers}
        async with self._session.post(engine.url + path, timeout=timeout, params=params, **kwargs) as resp:
            try:
                payload = await resp.json(content_type=None)  # SGLang answers some posts with an empty body
            except ValueError:
                payload = {"error": (await resp.text())[:2000]}
            if resp.status == 400:
                raise EngineRequestError(_error_text(payload))
            if resp.status != 200:
                raise RuntimeError(f"{engine.url}{path} answered HTTP {resp.status}: {payload}")
            if isinstance(payload, dict) and isinstance(payload.get("weight_version"), int):
                engine.weight_version = payload["weight_version"]  # the embedded engine answers with the new version
            elif path.startswith("/update_weights") and (sent := _version((params or {}).get("weight_version")
                                                                         if isinstance(body, bytes) else
                                                                         body.get("weight_version"))) is not None:
                engine.weight_version = sent  # SGLang answers {success, message}: it holds the version it was sent
            return payload

    async def post_all(self, path: str, body: dict[str, Any] | bytes, timeout_s: float | None = None,
                       params: dict[str, str] | None = None, engines: list[EngineEndpoint] | None = None) -> list[Any]:
        """POST to every engine in service (or to ``engines``); returns the answers of those that took it.
        One that fails is quarantined (and catches up when it returns); a refusal (HTTP 400) raises."""
        if (error := self.no_engine_left()) is not None:
            raise error

        async def one(engine: EngineEndpoint) -> Any:
            incarnation = engine.incarnation
            try:
                return await self.post(engine, path, body, timeout_s, params)
            except EngineRequestError:
                raise
            except Exception as exc:  # connection refused or reset, timeout, HTTP 5xx
                self._fail(engine, exc, incarnation)
                return None

        answers = await asyncio.gather(*(one(e) for e in (self.healthy if engines is None else engines)))
        return [a for a in answers if a is not None]

    async def abort(self) -> int:
        """Abort every request in flight on every engine in service (they answer with what they have)."""
        answers = await self.post_all("/abort_request", {"abort_all": True})
        return sum(a.get("aborted", 0) for a in answers if isinstance(a, dict))

    async def pause(self) -> None:
        """Hold generation on every engine in service (requests stay in flight), and on any re-admitted later."""
        self.paused = True
        await self.post_all("/pause_generation", PAUSE_IN_PLACE)

    async def resume(self) -> None:
        self.paused = False
        await self.post_all("/continue_generation", {})

    def _pick(self) -> EngineEndpoint | None:
        healthy = self.healthy
        return min(healthy, key=lambda e: (e.outstanding, e.served)) if healthy else None

    async def _wait_for_engine(self, deadline: float) -> EngineEndpoint:
        """The engine in service to send to, once there is one. Raises when none is left, when every engine has
        been down for ``no_engine_wait_s`` (see the module's docstring), or at ``deadline``."""
        self.waiting_for_engine += 1
        try:
            while (engine := self._pick()) is None:
                if (error := self.no_engine_left()) is not None:
                    raise error
                now, until = time.monotonic(), deadline
                if self.no_engine_wait_s is not None and all(e.down for e in self.engines):
                    since = max(e.down_since for e in self.engines)
                    if now >= since + self.no_engine_wait_s:
                        raise NoHealthyEngine(
                            f"no engine can serve the request: every engine has failed, and none answered a health "
                            f"check within {self.no_engine_wait_s:g} s of the last failure "
                            f"({self.setting('no_engine_wait_s')}). {self.describe()}")
                    until = min(deadline, since + self.no_engine_wait_s)
                if now > deadline:
                    raise NoHealthyEngine(f"no engine came back into service within {self.request_timeout_s:g} s "
                                          f"({self.setting('request_timeout_s')}): {self.describe()}")
                self._changed.clear()
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=min(1.0, max(0.01, until - now)))
                except asyncio.TimeoutError:
                    pass
            return engine
        finally:
            self.waiting_for_engine -= 1

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any] | None = None,
                       return_logprob: bool = True, rid: str | None = None,
                       return_routed_experts: bool = False, *, logprob_start_len: int = -1,
                       image_data: list[str] | None = None) -> dict[str, Any]:
        """Route one request; on a connection error or a dead engine, retry on another. ``logprob_start_len``
        >= 0 asks for the input's log-probs from there (``input_token_logprobs``, as SGLang answers it);
        ``image_data``: the prompt's images (SGLang's field; vision-language models)."""
        body = {"input_ids": input_ids, "sampling_params": sampling_params or {}, "return_logprob": return_logprob}
        if image_data:
            body["image_data"] = image_data
        if logprob_start_len >= 0:
            body["logprob_start_len"] = logprob_start_len
        if return_routed_experts:
            body["return_routed_experts"] = True
        if rid is not None:  # a named request can be aborted by name: it travels alone
            body["rid"] = rid
        if not self.batch_requests or rid is not None:
            return (await self._send([body]))[0]
        future = asyncio.get_running_loop().create_future()
        if not self._batch:
            asyncio.get_running_loop().call_soon(self._flush)
        self._batch.append((body, future))
        return await future

    def _flush(self) -> None:
        """Send this loop turn's requests: one batch per engine in service (at most), split evenly."""
        batch, self._batch = self._batch, []
        parts = max(1, min(len(batch), len(self.healthy)))
        size = -(-len(batch) // parts)
        for i in range(0, len(batch), size):
            task = asyncio.ensure_future(self._deliver(batch[i:i + size]))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _deliver(self, batch: list[tuple[dict[str, Any], asyncio.Future]]) -> None:
        try:
            answers: list[Any] = await self._send([body for body, _ in batch])
        except EngineRequestError as exc:
            if len(batch) == 1:
                answers = [exc]
            else:  # one request of the batch is wrong: each on its own, so that its error reaches it alone
                answers = await asyncio.gather(*(self._send([body]) for body, _ in batch), return_exceptions=True)
                answers = [a[0] if isinstance(a, list) else a for a in answers]
        except asyncio.CancelledError:  # the router closes
            for _, future in batch:
                future.cancel()
            raise
        except Exception as exc:  # no engine left ...
            answers = [exc] * len(batch)
        for (_, future), answer in zip(batch, answers):
            if future.done():  # its caller gave up waiting (timeout, cancellation)
                continue
            if isinstance(answer, BaseException):
                future.set_exception(answer)
            else:
                future.set_result(answer)

    async def _send(self, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """POST ``bodies`` as one ``/generate`` (batched when more than one) to the least loaded engine; on a
        connection error or a dead engine, retry on another. Returns the answers in order."""
        if len(bodies) == 1:
            body: dict[str, Any] = bodies[0]
        else:
            body = {key: [b[key] for b in bodies] for key in ("input_ids", "sampling_params", "return_logprob")}
            if any("return_routed_experts" in b for b in bodies):
                body["return_routed_experts"] = [b.get("return_routed_experts", False) for b in bodies]
            if any("logprob_start_len" in b for b in bodies):
                body["logprob_start_len"] = [b.get("logprob_start_len", -1) for b in bodies]
            if any("image_data" in b for b in bodies):
                body["image_data"] = [b.get("image_data") for b in bodies]
        deadline = time.monotonic() + self.request_timeout_s
        last_error: Exception | None = None
        for attempt in range(self.max_retries + 1):
            if time.monotonic() >= deadline:  # the attempts before took it all
                raise NoHealthyEngine(f"request timed out after {self.request_timeout_s:g} s "
                                      f"({self.setting('request_timeout_s')}) in {attempt} attempt(s); "
                                      f"last error: {type(last_error).__name__}: {last_error}")
            engine = await self._wait_for_engine(deadline)
            left_s = max(deadline - time.monotonic(), 1e-3)
            incarnation = engine.incarnation
            engine.outstanding += len(bodies)
            try:
                answer = await self.post(engine, "/generate", body, timeout_s=left_s)
            except EngineRequestError:
                raise
            except Exception as exc:  # connection refused or reset, engine died mid-request, no answer in time
                if isinstance(exc, asyncio.TimeoutError) and not str(exc):
                    exc = TimeoutError(f"no answer: timed out after {left_s:.3g} s")
                last_error = exc
                self._fail(engine, exc, incarnation)
                if attempt < self.max_retries:
                    self.stats["retries"] += len(bodies)
                continue
            finally:
                engine.outstanding -= len(bodies)
            answers = answer if len(bodies) > 1 else [answer]
            if not isinstance(answers, list) or len(answers) != len(bodies):
                raise RuntimeError(f"{self.name(engine)} answered a batch of {len(bodies)} requests with "
                                   f"{len(answers) if isinstance(answers, list) else type(answers).__name__}")
            instances = {a["meta_info"].get("engine_instance") for a in answers if isinstance(a, dict)}
            if not all(self._same_instance(engine, instance) for instance in instances):
                last_error = RuntimeError(f"{self.name(engine)} restarted: its answer is not of the weights pushed")
                continue  # quarantined: its answers are dropped, the request goes to an engine in service
            engine.served += len(bodies)
            # SGLang reports its version as a string ("7", or "default" before any update)
            versions = [_version(a["meta_info"].get("weight_version")) for a in answers]
            engine.weight_version = max([v for v in versions if v is not None], default=engine.weight_version)
            return answers
        raise NoHealthyEngine(f"request failed on {self.max_retries + 1} attempts ({self.setting('max_retries')}); "
                              f"last error: {type(last_error).__name__}: {last_error}")

    # -- failures -----------------------------------------------------------------------------------

    def _fail(self, engine: EngineEndpoint, error: Exception, incarnation: int | None = None) -> None:
        """Quarantine ``engine``; counted once until it answers again. An error from an earlier
        incarnation (a request sent before the engine failed and came back) is not its own."""
        if engine.down or (incarnation is not None and incarnation != engine.incarnation):
            return
        if engine.gone:  # it left the fleet (remove_engine): what becomes of it, its process killed, is no failure
            return
        engine.down = engine.quarantined = True
        engine.down_since = time.monotonic()
        engine.last_error = f"{type(error).__name__}: {error}"
        self.stats["engine_failures"] += 1
        log.warning("miles: %s failed and is quarantined: %s", self.name(engine), engine.last_error)
        self._changed.set()

    def _same_instance(self, engine: EngineEndpoint, instance: Any) -> bool:
        """Whether ``instance`` (what an answer says of the process that gave it) is the engine's: an engine that
        answers as another process restarted where it was (the same address) and holds none of the weights pushed
        to it. It is quarantined, as a failure, and serves again once caught up (:meth:`check`)."""
        if not isinstance(instance, str):
            return True  # SGLang tells nothing; a restarted server comes back at another address
        if engine.instance is None or engine.down:
            engine.instance = instance
            return True
        if instance == engine.instance:
            return True
        engine.instance = instance
        self._fail(engine, RuntimeError(f"it answers as a new process ({instance}): it restarted in place, and "
                                        f"holds none of the weights pushed to it"))
        return False

    def describe(self) -> str:
        """Each engine and its last error, for the errors that say why no engine served a request."""
        return "; ".join(f"{self.name(e)}{' cannot restart' if e.gone else ''}, last error: {e.last_error or 'none'}"
                         for e in self.engines)

    def no_engine_left(self) -> NoEngineLeft | None:
        """The error to raise when every engine is gone for good, else None."""
        if all(e.gone for e in self.engines):
            return NoEngineLeft(f"no engine left: all {len(self.engines)} failed and none can come back. "
                                   f"{self.describe()}")
        return None

    # -- health -------------------------------------------------------------------------------------

    async def check(self, engine: EngineEndpoint) -> bool:
        """One health check. An engine in service that fails ``max_failures`` in a row is quarantined; a
        quarantined one that answers again (its address re-resolved after a restart) is caught up
        (``on_readmit``) before it serves. Returns whether the engine is in service."""
        async with engine.lock:
            if engine.gone:
                return False
            try:
                if engine.down and engine.resolve is not None:
                    engine.url = (await engine.resolve()).rstrip("/")
                async with self._session.get(engine.url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                    if resp.status != 200:
                        raise RuntimeError(f"/health answered HTTP {resp.status}")
                    try:  # the embedded engine names its weight version; SGLang answers with an empty body
                        health = await resp.json(content_type=None)
                    except ValueError:
                        health = None
                    if isinstance(health, dict) and (version := _version(health.get("weight_version"))) is not None:
                        engine.weight_version = version
                    self._same_instance(engine, health.get("instance") if isinstance(health, dict) else None)
            except EngineGone as exc:  # only a failed engine is looked up again: it is quarantined already
                engine.gone = True
                log.warning("miles: %s cannot come back: %s", self.name(engine), exc)
                self._changed.set()
                return False
            except Exception as exc:
                engine.failures += 1
                if engine.failures >= self.max_failures:
                    self._fail(engine, exc)
                return False
            engine.failures = 0
            if engine.down:
                engine.down = False
                engine.incarnation += 1
            return not engine.quarantined or await self._readmit(engine)

    async def _readmit(self, engine: EngineEndpoint) -> bool:
        try:
            if self.paused:
                await self.post(engine, "/pause_generation", PAUSE_IN_PLACE)
            if self.on_readmit is not None:
                await self.on_readmit(engine)
        except EngineRequestError as exc:  # it refuses the catch-up: stays out, tried again at the next check
            if engine.last_error != (error := f"catch-up refused: {exc}"):
                engine.last_error = error
                log.warning("miles: %s: %s", self.name(engine), error)
            return False
        except Exception as exc:  # it failed while catching up: stays out, tried again once it answers
            self._fail(engine, exc)
            return False
        if engine.gone:  # removed from the fleet during its catch-up: it never serves
            return False
        # No await between the end of the catch-up and here: a push cannot slip in between.
        engine.quarantined = False
        self.stats["readmissions"] += 1
        log.warning("miles: %s is back in service at weight version %d", self.name(engine), engine.weight_version)
        self._changed.set()
        return True

    async def _watch(self, engine: EngineEndpoint) -> None:
        while not engine.gone:
            await self.check(engine)
            await asyncio.sleep(self.health_interval_s)

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
