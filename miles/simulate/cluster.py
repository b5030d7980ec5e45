"""A simulated cluster running Miles' own control plane: the schedules (:mod:`miles.loop.schedules`), the collector
and its partial rollouts, the stream's admission and staleness accounting, the builtin single-turn rollout
function, the router (picking, batching, retries, quarantine, catch-up) and the weight-push step, unchanged, on
the simulated clock of :class:`~miles.simulate.clock.VirtualLoop`. Only the engines' processes
(:class:`~miles.simulate.engines.SimEngine`), the trainer's passes and the push's transfer are models.

:func:`simulate` runs a :class:`Scenario` for its steps and returns each step's simulated times; the
:class:`Invariants` it asserts at every step (nothing trained twice or lost, staleness within its bound, engines in
service on the weights pushed) raise :class:`InvariantBroken` the moment one fails.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass, field
from statistics import fmean
from typing import Any

from miles.engine.router import EngineEndpoint, Router
from miles.loop.schedules import StreamSettings, make_schedule
from miles.loop.step import Step
from miles.rollout.collect import GroupCollector
from miles.rollout.context import RolloutContext
from miles.rollout.data_source import Prompt, PromptSource
from miles.rollout.oversampling import OverSampling
from miles.rollout.single_turn import single_turn
from miles.simulate.clock import VirtualLoop
from miles.simulate.engines import EngineModel, LengthModel, SimEngine, SimSession
from miles.types import Group, SampleStatus

__all__ = ["Faults", "InvariantBroken", "Scenario", "StepTimes", "Trainer", "simulate"]

_ZERO_COUNTS = (0, 0, 0, 0, 0, 0)


class InvariantBroken(AssertionError):
    """The control plane broke one of its promises in the simulation."""


@dataclass(frozen=True)
class Trainer:
    """The trainer's passes: ``tokens_per_s`` trained (forward and backward, the optimizer step) on its GPUs; the
    log-prob pass before training (``recompute_logprobs``) runs ``logprob_speedup`` times faster (a forward only)."""

    tokens_per_s: float
    recompute_logprobs: bool = True
    logprob_speedup: float = 3.0


@dataclass(frozen=True)
class Faults:
    """``kills_per_engine_hour``: engines die at random (exponential times, seeded) and come back after
    ``restart_s``; ``stragglers``: engine index -> slowdown factor; ``joins``: (simulated second, engines) added
    to the running fleet; ``leaves``: (simulated second, engines) leaving it (the first in service, drained)."""

    kills_per_engine_hour: float = 0.0
    restart_s: float = 120.0
    stragglers: dict[int, float] = field(default_factory=dict)
    joins: tuple[tuple[float, int], ...] = ()
    leaves: tuple[tuple[float, int], ...] = ()


@dataclass(frozen=True)
class Scenario:
    engines: int
    engine: EngineModel  # one engine's (of engine_gpus GPUs)
    trainer: Trainer
    lengths: LengthModel
    prompts_per_step: int
    n_samples: int
    max_new_tokens: int  # real tokens
    prompt_tokens: int  # real tokens
    update_s: float  # one weight push, engines updating in parallel
    schedule: str = "sync"
    max_staleness: int = 1
    partial_rollout: bool = False
    update: str = ""  # the stream's update mode; "" as Miles defaults it (abort with partial rollouts, else pause)
    colocated: bool = False  # the trainer on the engines' GPUs (sync only)
    steps: int = 4
    token_scale: int = 64  # real tokens per simulated one
    faults: Faults = Faults()
    seed: int = 0
    health_interval_s: float = 5.0
    batch_requests: bool = True  # cluster.router.batch_requests
    oversampling: float = 1.0  # the over_sampling selector's factor: more prompts a round than the batch needs


@dataclass
class StepTimes:
    """One step's simulated seconds (rollout: the trainer waiting for its batch)."""

    step: int
    step_s: float
    rollout_s: float
    logprob_s: float
    train_s: float
    update_s: float
    samples: int  # trained
    failed: int  # samples of the trained groups that failed (counted, not trained)
    tokens: int  # real tokens trained
    staleness_max: int
    metrics: dict[str, float] = field(default_factory=dict)  # what the real step reported (real-time entries aside)


class _Hooks:
    def __init__(self, loop: VirtualLoop) -> None:
        self.loop, self.rollout_end = loop, 0.0

    def miles_rollout_end(self, step: int, groups: list[Group]) -> None:
        self.rollout_end = self.loop.now


class _Plane:
    """The rollout plane as the loop sees it (:class:`miles.rollout.plane.RolloutPlane`), on the simulated loop."""

    remote = True
    local_engines: list[Any] = []

    def __init__(self, loop: VirtualLoop, router: Router) -> None:
        self.loop, self.router = loop, router

    @property
    def client(self) -> Router:
        return self.router

    @property
    def weight_version(self) -> int:
        return max(e.weight_version for e in self.router.engines)

    def run(self, coro: Any, timeout_s: float | None = None) -> Any:
        return self.loop.run(coro)

    def post_all(self, path: str, body: Any, timeout_s: float | None = None, params: Any = None) -> list[Any]:
        return self.loop.run(self.router.post_all(path, body, timeout_s, params))

    def release_memory(self) -> None:
        pass

    def resume_memory(self, *tags: str) -> None:
        pass

    def prefill_counts(self) -> tuple[int, ...]:
        return _ZERO_COUNTS

    def prefill_counts_soon(self) -> Any:
        return lambda: _ZERO_COUNTS


class _Transport:
    """The push: every engine in service updates (``update_s`` each, in parallel) through the router."""

    def __init__(self, sim: _Cluster) -> None:
        self.sim, self.latest, self.busy_s = sim, 0, 0.0
        self.pushing = False

    def push(self, backend: Any, plane: _Plane, version: int) -> None:
        start = plane.loop.now
        self.latest = version  # before it is sent, as the real transports record it: catch-ups bring this version
        self.pushing = True
        try:
            plane.post_all("/update_weights_from_tensor", {"weight_version": version})
        finally:
            self.pushing = False
        self.busy_s += plane.loop.now - start
        self.sim.invariants.after_push(self.sim, version)

    async def catch_up(self, endpoint: EngineEndpoint) -> None:
        """The router's ``on_readmit``: an engine back in service gets the weights pushed last (again, if a push
        began while it caught up), as :meth:`miles.weights.transports.TensorTransport.catch_up` does."""
        while endpoint.weight_version != self.latest:
            await self.sim.router.post(endpoint, "/update_weights_from_tensor", {"weight_version": self.latest})
        self.sim.invariants.readmitted(self.sim, endpoint, self.latest)


class _Learner:
    backend = None

    def __init__(self, sim: _Cluster) -> None:
        self.sim, self.version = sim, 0
        self.logprob_s = self.train_s = 0.0
        self.tokens = self.samples = self.failed = self.staleness_max = 0

    def learn(self, step: int, groups: list[Group], metrics: dict[str, float]) -> bool:
        sim, trainer = self.sim, self.sim.scenario.trainer
        samples = [s for g in groups for s in g.trainable_samples]
        sim.invariants.trained(sim, step, groups, self.version)
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples) * sim.scenario.token_scale
        self.logprob_s = tokens / (trainer.tokens_per_s * trainer.logprob_speedup) if trainer.recompute_logprobs else 0
        self.train_s = tokens / trainer.tokens_per_s
        self.tokens, self.samples = tokens, len(samples)
        self.failed = sum(s.status is SampleStatus.FAILED for g in groups for s in g.samples)
        versions = [v for s in samples for v in s.weight_versions]
        self.staleness_max = self.version - min(versions) if versions else 0
        sim.loop.run(asyncio.sleep(self.logprob_s + self.train_s))  # the engines go on meanwhile
        self.version = step + 1
        return bool(samples)


class Invariants:
    """What the control plane promises, checked as it happens."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.trained_groups: set[int] = set()
        self.trained_samples = 0

    def trained(self, sim: _Cluster, step: int, groups: list[Group], version: int) -> None:
        s = self.scenario
        for group in groups:
            if group.index in self.trained_groups:
                raise InvariantBroken(f"step {step}: group {group.index} trained a second time")
            self.trained_groups.add(group.index)
            for sample in group.samples:
                if sample.status is SampleStatus.PENDING:
                    raise InvariantBroken(f"step {step}: group {group.index} trains a sample still pending")
                if any(v > version for v in sample.weight_versions):
                    raise InvariantBroken(f"step {step}: a sample holds tokens of version "
                                          f"{max(sample.weight_versions)}, newer than the trainer's {version}")
                age = version - min(sample.weight_versions, default=version)
                if s.schedule != "sync" and age > s.max_staleness:
                    raise InvariantBroken(f"step {step}: a sample of group {group.index} is {age} versions old, "
                                          f"over max_staleness {s.max_staleness}")
                if s.schedule == "sync" and not s.partial_rollout and age != 0:
                    raise InvariantBroken(f"step {step}: a synchronous step trains tokens {age} versions old")
            self.trained_samples += len(group.samples)
        if len(groups) != s.prompts_per_step:
            raise InvariantBroken(f"step {step}: {len(groups)} groups trained, the batch is {s.prompts_per_step}")

    def serving(self, sim: _Cluster, engine: SimEngine) -> None:
        """A request reaches ``engine``: if the router takes it for the process it caught up (the same instance), it
        holds the weights pushed last, or the one before while a push is landing."""
        endpoint = sim.endpoints[engine.url]
        if endpoint.gone:
            raise InvariantBroken(f"a request reached {engine.url}, which left the fleet")
        if endpoint.instance != engine.instance:
            return  # restarted in place: the router drops its answers and catches it up (Router._same_instance)
        latest = sim.transport.latest
        if engine.version != latest and not (sim.transport.pushing and engine.version == latest - 1):
            raise InvariantBroken(f"{engine.url} serves a request on version {engine.version}; the fleet's is "
                                  f"{latest}")

    def after_push(self, sim: _Cluster, version: int) -> None:
        for endpoint in sim.router.healthy:
            engine = sim.engines[endpoint.url]
            if engine.alive and engine.version != version:
                raise InvariantBroken(f"{endpoint.url} is in service on version {engine.version} after the push of "
                                      f"version {version}")

    def readmitted(self, sim: _Cluster, endpoint: EngineEndpoint, version: int) -> None:
        engine = sim.engines[endpoint.url]
        if engine.alive and engine.version != version:
            raise InvariantBroken(f"{endpoint.url} comes back on version {engine.version}, the fleet's is {version}")

    def at_end(self, sim: _Cluster, admitted: int, in_pipeline: int, dropped: int) -> None:
        """Every group admitted was trained once, or is still in the pipeline, or was dropped as stale (counted)."""
        trained = len(self.trained_groups)
        if admitted != trained + in_pipeline + dropped:
            raise InvariantBroken(f"groups lost: {admitted} admitted, {trained} trained, {in_pipeline} in the "
                                  f"pipeline, {dropped} dropped (stale or surplus, counted)")


class _Cluster:
    def __init__(self, scenario: Scenario) -> None:
        self.scenario = s = scenario
        self.loop = VirtualLoop()
        self.rng = random.Random(s.seed)
        self.engines: dict[str, SimEngine] = {}
        self.endpoints: dict[str, EngineEndpoint] = {}  # the router's view of each engine, by URL
        self.invariants = Invariants(s)
        self.dropped = 0  # groups dropped (counted): too old for the stream (or generated again), a round's surplus
        self.transport = _Transport(self)
        self.router = Router([], health_interval_s=s.health_interval_s, request_timeout_s=10 * 86400.0,
                             on_readmit=self.transport.catch_up, batch_requests=s.batch_requests)
        for _ in range(s.engines):
            url = self._new_engine().url
            self.endpoints[url] = EngineEndpoint(url)
            self.router.engines.append(self.endpoints[url])
        self.loop.run(self._start())
        self.hooks = _Hooks(self.loop)
        self.plane = _Plane(self.loop, self.router)
        self.learner = _Learner(self)
        cap = max(1, s.max_new_tokens // s.token_scale)
        prompt = [1] * max(1, s.prompt_tokens // s.token_scale)
        prompts = [Prompt(index=i, prompt=f"p{i}", label="", prompt_ids=prompt) for i in range(100_000)]
        self.data = PromptSource.from_prompts(prompts, shuffle=False, seed=s.seed)
        selectors = [("over_sampling", OverSampling(s.oversampling))] if s.oversampling > 1 else []
        self.collector = GroupCollector(selectors, s.prompts_per_step, s.n_samples, partial_rollout=s.partial_rollout)
        ctx = RolloutContext(engine=self.router, tokenizer=None, sampling_params={"max_new_tokens": cap},
                             run=self.loop.run)
        self.step = Step(self.hooks, self.data, single_turn, ctx, _reward, self.collector, self.plane, self.learner,
                         self.transport, max_failed_frac=1.0, release_memory=s.colocated)
        settings = StreamSettings(max_staleness=s.max_staleness, update=s.update or
                                  ("abort" if s.partial_rollout else "pause"))
        self.schedule = make_schedule(s.schedule, self.step, settings, version=0)

    def _new_engine(self) -> SimEngine:
        s, index = self.scenario, len(self.engines)
        url = f"http://sim-engine-{index}"
        engine = SimEngine(url, s.engine, s.lengths, prompt_tokens=max(1, s.prompt_tokens // s.token_scale),
                           token_scale=s.token_scale, update_s=s.update_s, seed=s.seed * 100_003 + index,
                           speed=s.faults.stragglers.get(index, 1.0))
        self.engines[url] = engine
        return engine

    async def _start(self) -> None:
        await self.router.start()
        await self.router._session.close()  # the router's own HTTP session: replaced, nothing leaves the process
        self.router._session = SimSession(self.engines, on_generate=lambda e: self.invariants.serving(self, e))
        for engine in self.engines.values():
            engine.start()
        f = self.scenario.faults
        if f.kills_per_engine_hour > 0:
            asyncio.get_running_loop().create_task(self._kill_at_random())
        for at, count in f.joins:
            asyncio.get_running_loop().call_at(at, self._join, count)
        for at, count in f.leaves:
            asyncio.get_running_loop().call_at(at, lambda n=count: asyncio.ensure_future(self._leave(n)))

    def _join(self, count: int) -> None:
        """Engines join the running fleet (:meth:`Router.add_engine`): in service once caught up."""
        for _ in range(count):
            engine = self._new_engine()
            engine.start()
            self.endpoints[engine.url] = self.router.add_engine(engine.url)

    async def _leave(self, count: int) -> None:
        """Engines leave the running fleet (:meth:`Router.remove_engine`): what they hold finishes there."""
        leaving = self.router.healthy[:count]
        await asyncio.gather(*(self.router.remove_engine(e) for e in leaving))

    async def _kill_at_random(self) -> None:
        f = self.scenario.faults
        while True:
            await asyncio.sleep(self.rng.expovariate(f.kills_per_engine_hour * len(self.engines) / 3600.0))
            alive = [e for e in self.engines.values() if e.alive]
            if len(alive) <= 1:
                continue
            victim = self.rng.choice(alive)
            victim.kill()
            self.loop.call_later(f.restart_s, victim.restart)

    def run(self) -> list[StepTimes]:
        records = []
        for step in range(self.scenario.steps):
            start = self.loop.now
            metrics = self.schedule.step(step)
            end = self.loop.now
            learner = self.learner
            rollout_s = self.hooks.rollout_end - start
            records.append(StepTimes(step, end - start, rollout_s, learner.logprob_s, learner.train_s,
                                     self.transport.busy_s, learner.samples, learner.failed, learner.tokens,
                                     learner.staleness_max,
                                     {**{k: v for k, v in metrics.items() if not k.startswith("time/")},
                                      "sim/engines_left": sum(e.gone for e in self.router.engines)}))
            self.transport.busy_s = 0.0
            self.dropped += int(metrics.get("async/stale_dropped", 0) + metrics.get("async/stale_retried", 0)
                                + metrics.get("selection/surplus_dropped", 0))
        self._finish()
        return records

    def _finish(self) -> None:
        schedule = self.schedule
        if self.scenario.schedule == "sync":
            admitted = self.collector.next_group_index
            in_pipeline = len(self.collector.unfinished)
        else:
            stream = schedule.stream
            schedule.settle()
            admitted = stream.admitted
            in_pipeline = len(stream.flights) + len(stream.ready)
        self.invariants.at_end(self, admitted, in_pipeline, self.dropped)

    def close(self) -> None:
        try:
            self.schedule.close()
        finally:
            self.loop.run(self.router.close())
            for task in asyncio.all_tasks(self.loop):
                task.cancel()
            self.loop.run(asyncio.sleep(0))
            self.loop.close()


def _reward(sample: Any) -> float:
    return 1.0 if sample.status is SampleStatus.COMPLETED else 0.0


def simulate(scenario: Scenario) -> list[StepTimes]:
    """Run ``scenario``'s steps on the simulated clock; each step's simulated times."""
    quiet = logging.getLogger("miles")  # the router's warnings on every simulated failure, while it runs
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        cluster = _Cluster(scenario)
        try:
            return cluster.run()
        finally:
            cluster.close()
    finally:
        quiet.setLevel(level)


def summary(records: list[StepTimes], skip: int = 1) -> dict[str, float]:
    """Means over the steps after the first ``skip`` (the pipeline filling); ``samples_per_s``: the samples trained
    in those steps over their time."""
    steady = records[skip:] or records
    step_s = fmean(r.step_s for r in steady)
    return {"step_s": step_s, "rollout_s": fmean(r.rollout_s for r in steady),
            "logprob_s": fmean(r.logprob_s for r in steady), "train_s": fmean(r.train_s for r in steady),
            "update_s": fmean(r.update_s for r in steady),
            "samples_per_s": sum(r.samples for r in steady) / sum(r.step_s for r in steady),
            "staleness_max": max(r.staleness_max for r in steady),
            "tokens_per_step": fmean(r.tokens for r in steady), "steps": len(steady)}
