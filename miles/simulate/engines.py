"""Simulated engines: continuous batching on the simulated clock, answering the SGLang protocol Miles' router speaks.

A :class:`SimEngine` holds running rows and a queue like the real engine: it admits waiting requests at a decode
step (up to ``max_running``), advances every row one token per step, and answers a row when it stops (its sampled
length), reaches its budget (``max_new_tokens``) or is aborted. It steps from event to event (an arrival, a row's
end), never token by token: between two events the batch does not change, so ``k`` steps take ``k`` times the
step time of :class:`EngineModel`. Weight updates, pauses, aborts, health checks, deaths and restarts behave as
the router expects of a real engine.

:class:`SimSession` stands in for the router's ``aiohttp`` session: the router's own code picks engines, batches,
retries, quarantines and catches up, unchanged; only the bytes never leave the process.

Lengths. A request's response length is drawn from a :class:`LengthModel` when it arrives, conditioned on the
tokens it already holds (a partial rollout continued later keeps to the same distribution, as a real model's
stop would). Every simulated token stands for ``token_scale`` real ones (times and lengths are in real units).
"""

from __future__ import annotations

import asyncio
import math
import random
import uuid
from dataclasses import dataclass, field
from typing import Any

__all__ = ["EngineModel", "LengthModel", "SimEngine", "SimSession", "EngineDown"]


class EngineDown(ConnectionError):
    """The engine's process is gone: what a request to a dead server gets."""


@dataclass(frozen=True)
class EngineModel:
    """Seconds per decode step of one engine of ``gpus`` GPUs: ``fixed + per_row * rows + per_context_token *
    context`` (the step's weights and launch, each row's share of the experts' and heads' compute, the KV cache read
    for every token the rows hold), plus ``per_prefill_token`` for each prompt token admitted."""

    fixed_s: float
    per_row_s: float
    per_context_token_s: float
    per_prefill_token_s: float
    max_running: int = 256

    def step_s(self, rows: int, context: int) -> float:
        return self.fixed_s + self.per_row_s * rows + self.per_context_token_s * context

    @classmethod
    def calibrated(cls, *, tokens_per_gpu_s: float, gpus: int, full_rows: int, full_context: float,
                   single_row_tokens_s: float, kv_bytes_per_token: float, memory_bandwidth_gbs: float,
                   prefill_ratio: float = 20.0, max_running: int = 256) -> EngineModel:
        """The model that decodes ``tokens_per_gpu_s`` per GPU with ``full_rows`` rows holding ``full_context``
        tokens each on average, ``single_row_tokens_s`` with one row, and reads ``kv_bytes_per_token`` of KV cache
        per context token at the engine's aggregate ``memory_bandwidth_gbs``; a prompt token prefills
        ``prefill_ratio`` times faster than a decode step's per-row share."""
        fixed = 1.0 / single_row_tokens_s
        per_context = kv_bytes_per_token / (memory_bandwidth_gbs * 1e9 * gpus)
        full_step = full_rows / (tokens_per_gpu_s * gpus)
        per_row = (full_step - fixed - per_context * full_rows * full_context) / full_rows
        if per_row <= 0:
            raise ValueError(f"no engine decodes {tokens_per_gpu_s} tokens per GPU per second with {full_rows} rows "
                             f"and a {fixed * 1e3:.1f} ms step for one row: the figures contradict each other")
        return cls(fixed, per_row, per_context, (full_step / full_rows) / prefill_ratio, max_running)


@dataclass(frozen=True)
class LengthModel:
    """Response lengths (real tokens): log-normal with ``median`` and ``sigma``; a response that has not stopped by
    ``max_new_tokens`` is truncated there."""

    median: float
    sigma: float

    def draw(self, rng: random.Random, already: float) -> float:
        """A length longer than ``already`` (the tokens a continued request holds), from the distribution
        conditioned on that."""
        if already <= 0:
            return rng.lognormvariate(math.log(self.median), self.sigma)
        z0 = (math.log(already) - math.log(self.median)) / self.sigma
        below = 0.5 * math.erfc(-z0 / math.sqrt(2))  # P(L <= already)
        u = below + (1 - below) * rng.random()
        u = min(max(u, 1e-12), 1 - 1e-12)
        return math.exp(math.log(self.median) + self.sigma * _normal_quantile(u))

    @classmethod
    def with_mean(cls, mean: float, sigma: float, cap: float) -> LengthModel:
        """The log-normal whose lengths, truncated at ``cap``, average ``mean``."""
        lo, hi = 1.0, cap * 100
        for _ in range(100):
            mid = math.sqrt(lo * hi)
            if cls(mid, sigma).truncated_mean(cap) < mean:
                lo = mid
            else:
                hi = mid
        return cls(math.sqrt(lo * hi), sigma)

    def truncated_mean(self, cap: float) -> float:
        mu, s = math.log(self.median), self.sigma
        z = (math.log(cap) - mu) / s
        phi = lambda x: 0.5 * math.erfc(-x / math.sqrt(2))  # noqa: E731
        return math.exp(mu + s * s / 2) * phi(z - s) + cap * (1 - phi(z))

    def truncated_frac(self, cap: float) -> float:
        return 0.5 * math.erfc((math.log(cap) - math.log(self.median)) / self.sigma / math.sqrt(2))


def _normal_quantile(p: float) -> float:
    """The standard normal's inverse CDF (Acklam's rational approximation, refined by one Newton step)."""
    a = (-3.969683028665376e01, 2.209460984245205e02, -2.759285104469687e02, 1.383577518672690e02,
         -3.066479806614716e01, 2.506628277459239e00)
    b = (-5.447609879822406e01, 1.615858368580409e02, -1.556989798598866e02, 6.680131188771972e01,
         -1.328068155288572e01)
    c = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e00, -2.549732539343734e00,
         4.374664141464968e00, 2.938163982698783e00)
    d = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e00, 3.754408661907416e00)
    if p < 0.02425:
        q = math.sqrt(-2 * math.log(p))
        x = (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) / \
            ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1)
    elif p > 1 - 0.02425:
        q = math.sqrt(-2 * math.log(1 - p))
        x = -(((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) / \
            ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1)
    else:
        q = p - 0.5
        r = q * q
        x = (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q / \
            (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1)
    e = 0.5 * math.erfc(-x / math.sqrt(2)) - p
    return x - e * math.sqrt(2 * math.pi) * math.exp(x * x / 2)


_TRIPLE = [-1.0, 1, None]  # one output token's [logprob, id, text]: every simulated token is token 1


@dataclass(eq=False)
class _Row:
    prompt: int  # simulated tokens of input (the prompt, and what a continued request already holds)
    budget: int  # max_new_tokens
    stop_at: int  # the sampled length, in new tokens of this request
    future: asyncio.Future
    done: int = 0
    versions: list[list[int]] = field(default_factory=list)  # [version, tokens] runs

    def take(self, tokens: int, version: int) -> None:
        self.done += tokens
        if self.versions and self.versions[-1][0] == version:
            self.versions[-1][1] += tokens
        else:
            self.versions.append([version, tokens])

    @property
    def left(self) -> int:
        return min(self.budget, self.stop_at) - self.done


class SimEngine:
    """One engine's process, simulated. ``speed``: a straggler's factor on every step time (3.0: three times
    slower)."""

    def __init__(self, url: str, model: EngineModel, lengths: LengthModel, *, prompt_tokens: int, token_scale: int,
                 update_s: float, seed: int, speed: float = 1.0) -> None:
        self.url, self.model, self.lengths = url, model, lengths
        self.prompt_tokens, self.token_scale, self.update_s = prompt_tokens, token_scale, update_s
        self.speed = speed
        self.rng = random.Random(seed)
        self.alive = True
        self.instance = uuid.uuid4().hex[:8]
        self.version = 0
        self.rows: list[_Row] = []
        self.queue: list[_Row] = []
        self.paused = False
        self.updating = 0
        self.busy_s = 0.0  # simulated seconds spent decoding or prefilling
        self.tokens = 0  # simulated tokens generated
        self._wake = asyncio.Event()
        self._interval: tuple[float, float, float] | None = None  # the batch's: its start, prefill and step seconds
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._serve())

    # -- the protocol -------------------------------------------------------------------------------

    async def handle(self, path: str, body: Any) -> Any:
        self._check_alive()
        if path == "/generate":
            if isinstance(body["input_ids"][0], list):  # the router's batch of requests
                answers = [self._submit(ids, params) for ids, params in zip(body["input_ids"],
                                                                              body["sampling_params"])]
                return list(await asyncio.gather(*answers))
            return await self._submit(body["input_ids"], body["sampling_params"])
        if path == "/abort_request":
            return {"aborted": self.abort()}
        if path == "/pause_generation":
            self.paused = True
            return {}
        if path == "/continue_generation":
            self.paused = False
            self._wake.set()
            return {}
        if path.startswith("/update_weights"):
            return {"weight_version": await self._update(int(body["weight_version"]))}
        raise ValueError(f"the simulated engine does not serve {path}")

    def health(self) -> dict[str, Any]:
        self._check_alive()
        return {"weight_version": self.version, "instance": self.instance}

    def _check_alive(self) -> None:
        if not self.alive:
            raise EngineDown(f"{self.url}: connection refused")

    def _submit(self, input_ids: list[int], params: dict[str, Any]) -> asyncio.Future:
        held = max(0, len(input_ids) - self.prompt_tokens)
        length = self.lengths.draw(self.rng, held * self.token_scale) / self.token_scale
        row = _Row(len(input_ids), int(params.get("max_new_tokens", 16)), max(1, math.ceil(length - held)),
                   asyncio.get_running_loop().create_future())
        self.queue.append(row)
        self._wake.set()
        return row.future

    def abort(self) -> int:
        self._credit()  # the rows keep the tokens of the steps they finished
        rows, self.rows, queued, self.queue = self.rows, [], self.queue, []
        for row in rows + queued:
            self._answer(row, "abort")
        return len(rows) + len(queued)

    async def _update(self, version: int) -> int:
        self.updating += 1  # decoding stops (after the step in progress) while the weights are written
        self._wake.set()
        try:
            await asyncio.sleep(self.update_s)
            self._check_alive()
            self.version = max(self.version, version)
        finally:
            self.updating -= 1
            self._wake.set()
        return self.version

    # -- faults -------------------------------------------------------------------------------------

    def kill(self) -> None:
        """The process dies: every request in flight fails, nothing answers until :meth:`restart`."""
        self.alive = False
        self._interval = None
        rows, self.rows, queued, self.queue = self.rows, [], self.queue, []
        for row in rows + queued:
            if not row.future.done():
                row.future.set_exception(EngineDown(f"{self.url}: connection reset"))
        self._wake.set()

    def restart(self) -> None:
        """A fresh process at the same address: no weights pushed (version 0), a new instance."""
        self.alive, self.version, self.instance = True, 0, uuid.uuid4().hex[:8]
        self._wake.set()

    # -- decoding -----------------------------------------------------------------------------------

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.alive or self.paused or self.updating or not (self.rows or self.queue):
                self._wake.clear()
                await self._wake.wait()
                continue
            prefill = 0
            room = self.model.max_running - len(self.rows)
            if room > 0 and self.queue:
                admitted, self.queue = self.queue[:room], self.queue[room:]
                prefill = sum(r.prompt for r in admitted) * self.token_scale
                self.rows += admitted
            context = sum(r.prompt + r.done for r in self.rows) * self.token_scale
            step = self.model.step_s(len(self.rows), context) * self.token_scale * self.speed
            steps = max(1, min(min(r.left for r in self.rows), 64))  # the context is looked at again every 64 steps
            prefill_s = prefill * self.model.per_prefill_token_s * self.speed
            self._interval = (loop.time(), prefill_s, step)
            self._wake.clear()
            duration = prefill_s + steps * step
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=duration)
            except asyncio.TimeoutError:
                pass
            if self._interval is not None and self.alive:  # woken mid-step (an arrival): the step in progress ends
                start, _, _ = self._interval
                elapsed = loop.time() - start
                if elapsed < duration:
                    boundary = start + prefill_s + max(0, math.ceil((elapsed - prefill_s) / step - 1e-9)) * step
                    if boundary > loop.time():
                        await asyncio.sleep(boundary - loop.time())
            self._credit()
            finished = [r for r in self.rows if r.left <= 0]
            self.rows = [r for r in self.rows if r.left > 0]
            for row in finished:
                self._answer(row, "stop" if row.done >= row.stop_at else "length")

    def _credit(self) -> None:
        """Give the rows the tokens of the steps done since the interval began."""
        if self._interval is None:
            return
        start, prefill_s, step = self._interval
        self._interval = None
        elapsed = asyncio.get_running_loop().time() - start
        self.busy_s += elapsed
        if not self.rows:
            return
        done = min(min(r.left for r in self.rows), int(max(0.0, elapsed - prefill_s) / step + 1e-9))
        if done > 0:
            self.tokens += done * len(self.rows)
            for row in self.rows:
                row.take(done, self.version)

    def _answer(self, row: _Row, finish: str) -> None:
        if row.future.done():
            return
        meta: dict[str, Any] = {
            "finish_reason": {"type": finish, **({"message": "aborted"} if finish == "abort" else {})},
            "weight_version": row.versions[-1][0] if row.versions else self.version,
            "engine_instance": self.instance, "prompt_tokens": row.prompt, "completion_tokens": row.done,
            "output_token_logprobs": [_TRIPLE] * row.done,
        }
        if len(row.versions) > 1:
            meta["output_token_weight_versions"] = [v for v, n in row.versions for _ in range(n)]
        row.future.set_result({"text": "", "output_ids": [1] * row.done, "meta_info": meta})


class _Response:
    def __init__(self, payload: Any) -> None:
        self.status, self._payload = 200, payload

    async def json(self, content_type: Any = None) -> Any:
        return self._payload

    async def text(self) -> str:
        return str(self._payload)

    async def __aenter__(self) -> _Response:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None


class _Call:
    def __init__(self, coro: Any) -> None:
        self._coro = coro

    async def __aenter__(self) -> _Response:
        return _Response(await self._coro)

    async def __aexit__(self, *exc: object) -> None:
        return None


class SimSession:
    """What :class:`miles.engine.router.Router` posts and gets through, for simulated engines by URL."""

    def __init__(self, engines: dict[str, SimEngine], on_generate: Any = None) -> None:
        self.engines = engines
        self.on_generate = on_generate  # called with the engine each /generate reaches (the invariants' look)

    def post(self, url: str, *, json: Any = None, data: Any = None, timeout: Any = None, params: Any = None,
             headers: Any = None) -> _Call:
        return _Call(self._post(url, json, timeout))

    def get(self, url: str, *, timeout: Any = None, headers: Any = None) -> _Call:
        return _Call(self._health(url))

    async def _post(self, url: str, body: Any, timeout: Any) -> Any:
        engine, path = self._engine(url)
        if path == "/generate" and self.on_generate is not None:
            self.on_generate(engine)
        total = getattr(timeout, "total", None)
        return await asyncio.wait_for(engine.handle(path, body), total) if total else await engine.handle(path, body)

    async def _health(self, url: str) -> Any:
        engine, _ = self._engine(url)
        return engine.health()

    def _engine(self, url: str) -> tuple[SimEngine, str]:
        cut = url.find("/", url.find("//") + 2)  # http://host[:port] | /path
        engine = self.engines.get(url[:cut]) if cut > 0 else None
        if engine is None:
            raise EngineDown(f"{url}: no such engine")
        return engine, url[cut:]

    async def close(self) -> None:
        return None
