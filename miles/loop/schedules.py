"""How rollout and training share time (``run.schedule``), on the stages of :mod:`miles.loop.step`.

Every schedule composes the same stages (:mod:`miles.loop.step`): collect -> learn -> push.

``sync``: each step collects its groups, then learns on them and pushes (:func:`miles.loop.step.sync_step`).

``one_step_off`` and ``async`` run a :class:`GroupStream` on the rollout plane's event loop, beside the
trainer: prompts are admitted, their groups generated, rewarded and selected as each completes, and
kept groups wait in a buffer until the trainer takes a batch. ``one_step_off`` admits one whole step
of prompts when the trainer takes the last, so step k+1 generates while step k trains (staleness 1). ``async``
admits a group whenever there is room (sample-level scheduling: a finished group's slot is refilled at
once, long trajectories never hold a batch).

Staleness. A group's age when taken is the trainer's weight version minus the oldest version that
sampled any of its tokens. Admission is paced so that no more groups are in the pipeline (generating,
buffered, or in the trainer's hands) than ``max_staleness + 1`` steps consume: in order, every one of
them is trained within ``max_staleness`` versions. A group that still ends up older (it finished late)
is never trained: dropped, or its prompt generated again first (``stale: retry``). The trainer takes
the oldest buffered groups first. ``max_staleness: 0`` is ``sync``, and runs as such
(:func:`miles.config.prepared.resolve_schedule`) unless ``max_concurrent_samples`` caps the stream.

Weight updates while generating (``update``): ``pause`` holds new requests and lets those running finish
on the old weights, then updates; ``abort`` aborts the running requests (they keep their tokens), updates,
and continues them on the new weights; ``in_place`` updates between two decode steps while requests run
on. Every token keeps the version that sampled it (:meth:`miles.types.Sample.record_versions`), and the
tokens of an older version than a sample's newest are its ``off_policy_tokens`` (``rollout.mask_off_policy``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import time
from dataclasses import dataclass, field, replace
from statistics import fmean
from typing import Any

from miles.config.schema import SCHEDULES
from miles.hookspecs import SnapshotTransport
from miles.loop.step import Step, check_failures, finish_step, push_weights, rollout_metrics, sync_step
from miles.rollout.collect import Collected
from miles.rollout.data_source import Prompt
from miles.rollout.generate import make_groups, run_one
from miles.rewards.scoring import score_samples_async
from miles.types import Group, Sample, SampleStatus

__all__ = ["SCHEDULES", "GroupStream", "StreamSettings", "make_schedule", "stream_settings"]


@dataclass
class StreamSettings:
    max_staleness: int = 1
    max_concurrent_samples: int = 0  # 0: as many as the pacing allows
    stale: str = "drop"  # or "retry"
    update: str = "pause"  # or "abort", "in_place"
    whole_steps: bool = False  # one_step_off: admit one step's prompts at a time


class _GatedEngine:
    """The engine as the stream's rollouts see it: a request waits while a weight update holds the gate, and
    the stream knows how many are running. Everything else is the engine's."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.gate = asyncio.Event()
        self.gate.set()
        self.running = 0
        self.idle = asyncio.Event()
        self.idle.set()

    async def generate(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        while not self.gate.is_set():
            await self.gate.wait()
        self.running += 1
        self.idle.clear()
        try:
            return await self.engine.generate(*args, **kwargs)
        finally:
            self.running -= 1
            if self.running == 0:
                self.idle.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


@dataclass(eq=False)
class _Flight:
    group: Group
    prompt: Prompt
    admitted_version: int
    task: asyncio.Task | None = field(default=None, repr=False)


class GroupStream:
    """Generates groups continuously on the plane's loop; the trainer takes batches with :meth:`take`
    and updates the weights with :meth:`update`. Every method but :meth:`update` runs on the plane's loop."""

    def __init__(self, c: Step, settings: StreamSettings, version: int) -> None:
        self.c, self.s = c, settings
        self.batch = c.prompts_per_step
        self.version = version  # the weights the trainer holds (and the engines serve, between updates)
        self.engine = _GatedEngine(c.ctx.engine)
        self.ctx = replace(c.ctx, engine=self.engine)
        self.flights: list[_Flight] = []
        self.ready: list[tuple[_Flight, int]] = []  # kept groups with their start version, waiting for the trainer
        self.held: list[int] = []  # per batch the trainer took and whose weights have not reached the engines: its size
        self.admitted = 0  # groups admitted since the stream started
        self.completed: list[Sample] = []  # samples finished since the last take
        self.removed = [0] * len(c.collector.selectors)
        self.aborts = 0  # weight updates that aborted running requests
        self.idle_s = 0.0  # time with nothing generating, since the last take
        self._idle_since: float | None = time.perf_counter()
        self._changed = asyncio.Event()
        self._admitter: asyncio.Task | None = None
        self._error: BaseException | None = None

    # -- the producer -------------------------------------------------------------------------------

    def start(self) -> None:
        self._admitter = asyncio.get_running_loop().create_task(self._admit_forever())

    @property
    def cap(self) -> int:
        """Groups the pipeline may hold: those trained within ``max_staleness`` versions."""
        return (self.s.max_staleness + 1) * self.batch

    def _room(self) -> int:
        if self.s.whole_steps:  # the next step's prompts, once the last are done (a selector may have left it short)
            # and the engines hold the weights of the trainer that took the last batch (no push of older ones left
            # to land): generated on them, they are trained one version later, never two
            landed = len(self.held) <= 1
            return self.batch - len(self.ready) if landed and not self.flights and len(self.ready) < self.batch else 0
        room = self.cap - len(self.flights) - len(self.ready) - sum(self.held)
        if self.s.max_concurrent_samples:
            running = sum(len(f.group.samples) for f in self.flights)
            room = min(room, (self.s.max_concurrent_samples - running) // self.c.n_samples)
        return room

    async def _admit_forever(self) -> None:
        try:
            while True:
                count = self._room()
                if count <= 0:
                    self._changed.clear()
                    await self._changed.wait()
                    continue
                self._admit(count)
                await asyncio.sleep(0)  # let the new rollouts reach the engine together
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the data or a selector failed: the trainer hears of it in take()
            self._error = exc
            self._notify()

    def _admit(self, count: int) -> None:
        c = self.c
        prompts = c.data.draw(count, c.collector.chooser)
        groups = make_groups(prompts, c.n_samples, first_group_index=c.collector.next_group_index)
        c.collector.next_group_index += len(groups)
        if self._idle_since is not None:
            self.idle_s += time.perf_counter() - self._idle_since
            self._idle_since = None
        for group, prompt in zip(groups, prompts):
            flight = _Flight(group, prompt, self.version)
            flight.task = asyncio.ensure_future(self._run(flight))
            self.flights.append(flight)
            self.admitted += 1

    async def _run(self, flight: _Flight) -> None:
        c, group = self.c, flight.group
        try:
            while True:
                aborts = self.aborts
                todo = [s for s in group.samples if s.status in (SampleStatus.PENDING, SampleStatus.ABORTED)]
                for sample in todo:
                    sample.status = SampleStatus.PENDING
                await asyncio.gather(*(run_one(c.rollout_fn, s, self.ctx) for s in todo))
                aborted = [s for s in group.samples if s.status is SampleStatus.ABORTED]
                if not aborted:
                    break
                if self.aborts == aborts:  # not by a weight update: the engine gave up on them
                    for sample in aborted:
                        sample.fail(f"rollout: the engine aborted the generation ({sample.reason})")
            await score_samples_async(group.samples, c.reward_fn)
            selected, removed = c.collector.select([group])
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # e.g. no engine left: the run cannot go on
            self._error = exc
            self._notify()
            return
        self.flights.remove(flight)
        self.completed += group.samples
        self.removed = [a + b for a, b in zip(self.removed, removed)]
        if selected:
            versions = [s.start_version for s in group.samples if s.start_version is not None]
            self.ready.append((flight, min(versions, default=flight.admitted_version)))
        if not self.flights and self._idle_since is None:
            self._idle_since = time.perf_counter()
        self._notify()

    def _notify(self) -> None:
        self._changed.set()

    # -- the trainer's side -------------------------------------------------------------------------

    async def take(self, version: int) -> tuple[list[Group], list[Sample], dict[str, float]]:
        """The next batch for the trainer holding weights ``version`` (the oldest groups first), the samples
        completed since the last take, and the stream's metrics. Groups too old for ``version`` are dropped or
        retried here, never returned."""
        waited = time.perf_counter()
        stale = 0
        while True:
            if self._error is not None:
                raise self._error
            for entry in [e for e in self.ready if version - e[1] > self.s.max_staleness]:
                self.ready.remove(entry)
                stale += 1
                if self.s.stale == "retry":  # generated again before anything new
                    self.c.data.requeued.insert(0, entry[0].prompt)
                self._notify()
            if len(self.ready) >= self.batch:
                break
            self._changed.clear()
            await self._changed.wait()
        self.ready.sort(key=lambda e: (e[1], e[0].group.index))
        taken, self.ready = self.ready[: self.batch], self.ready[self.batch :]
        self.held.append(len(taken))
        self._notify()  # one_step_off admits the next step now
        groups = sorted((f.group for f, _ in taken), key=lambda g: g.index)
        ages = [version - start for _, start in taken]
        samples, self.completed = self.completed, []
        idle = self.idle_s + (time.perf_counter() - self._idle_since if self._idle_since is not None else 0.0)
        self.idle_s, self._idle_since = 0.0, (time.perf_counter() if self._idle_since is not None else None)
        metrics = {
            "async/staleness_mean": fmean(ages), "async/staleness_max": max(ages),
            "async/stale_dropped": stale if self.s.stale == "drop" else 0,
            "async/stale_retried": stale if self.s.stale == "retry" else 0,
            "async/buffer_groups": len(self.ready), "async/in_flight_groups": len(self.flights),
            "async/groups_admitted": self.admitted,  # since the run (re)started: every group's fate adds up
            "async/trainer_wait_s": time.perf_counter() - waited, "async/rollout_wait_s": idle,
        }
        removed, self.removed = self.removed, [0] * len(self.removed)
        metrics.update(self.c.collector.selection_metrics(samples, groups, removed))
        return groups, samples, metrics

    async def hold(self) -> None:
        """Before an update (``pause``/``abort``): no new request starts, the running ones finish."""
        self.engine.gate.clear()
        if self.s.update == "abort":
            self.aborts += 1
            result = self.engine.engine.abort()
            if inspect.isawaitable(result):
                await result
        await self.engine.idle.wait()

    async def release(self, version: int) -> None:
        """After an update (or a batch with nothing to train): the engines' version, room for what the oldest
        batch held, the gate open."""
        self.version = version
        if self.held:
            self.held.pop(0)
        self.engine.gate.set()
        self._notify()

    async def snapshot(self) -> tuple[int, list[Prompt]]:
        """The data's position and every prompt served and not yet trained on (in flight, buffered, requeued),
        oldest first: what a checkpoint keeps, so that a resumed run generates them again before anything new.
        Read on the loop, where no admission is half done."""
        flights = self.flights + [f for f, _ in self.ready]
        pending = [f.prompt for f in sorted(flights, key=lambda f: f.group.index)]
        return self.c.data.position, pending + list(self.c.data.requeued)

    async def stop(self) -> None:
        tasks = [t for t in [self._admitter, *(f.task for f in self.flights)] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _Exported:
    """A backend's weights copied at one moment: what a push sent later, while the trainer goes on, reads."""

    def __init__(self, weights: dict[str, Any]) -> None:
        self.weights = weights

    def export_weights(self) -> dict[str, Any]:
        return self.weights


class StreamSchedule:
    """``one_step_off`` and ``async``: the trainer's loop over a :class:`GroupStream`.

    A weight push runs in a thread of its own while the trainer trains the next batch, from a copy of the
    weights taken when the step ended (for transports that read only ``export_weights``; others push before
    the step ends). The next push, a checkpoint, an evaluation and the end of the run wait for it."""

    def __init__(self, c: Step, settings: StreamSettings, version: int) -> None:
        self.c, self.closed = c, False
        self.settings = settings
        self.version = version  # the trainer's weights
        self._pusher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="miles-push")
        self._pushing: concurrent.futures.Future | None = None

        async def start() -> GroupStream:
            stream = GroupStream(c, settings, version)
            stream.start()
            return stream

        self.prefill_seen = c.plane.prefill_counts()  # the stream's prefills since the last batch are the step's
        self.stream: GroupStream = c.plane.run(start())

    def step(self, step: int) -> dict[str, float]:
        c, stream, start = self.c, self.stream, time.perf_counter()
        groups, samples, stream_metrics = c.plane.run(stream.take(self.version))
        rollout_s = time.perf_counter() - start
        prefill_now = c.plane.prefill_counts_soon()  # the engines answer while the trainer trains
        failed = check_failures(step, samples, c.max_failed_frac)
        c.hooks.miles_rollout_end(step=step, groups=groups)
        metrics: dict[str, float] = {}
        sync_s = 0.0
        if c.learner.learn(step, groups, metrics):
            if c.draft is not None:  # towards the policy just learnt, before both are pushed
                metrics.update(c.draft.learn(groups, c.learner.backend))
            sync_start = time.perf_counter()
            self._update(step)
            sync_s = time.perf_counter() - sync_start
        else:
            c.plane.run(stream.release(stream.version))  # nothing trained, nothing pushed: the batch is done
        metrics["time/weight_sync_s"] = sync_s
        prefill_before, self.prefill_seen = self.prefill_seen, prefill_now()
        metrics = {**rollout_metrics(c, Collected(groups, samples, stream_metrics), rollout_s, prefill_before, failed,
                                     prefill_after=self.prefill_seen), **metrics}
        metrics = finish_step(c, metrics, start)
        metrics["weight_version"] = self.version  # the engines have it, or will once the push in flight lands
        return metrics

    def _update(self, step: int) -> None:
        self.settle()
        self.version = step + 1
        if isinstance(self.c.transport, SnapshotTransport) and self.c.transport.exports_only:
            backend = self.c.learner.backend
            weights = backend.export_weights()
            if not getattr(backend, "exports_copies", False):  # the backend's own tensors: it trains them next
                weights = {k: v.detach().clone() for k, v in weights.items()}
            self._pushing = self._pusher.submit(self._push, step, _Exported(weights))
        else:
            self._push(step, self.c.learner.backend)

    def _push(self, step: int, backend: Any) -> None:
        """Push the weights trained at ``step`` the configured way (``update``)."""
        plane, stream = self.c.plane, self.stream
        if self.settings.update != "in_place":
            plane.run(stream.hold())
        try:
            push_weights(self.c, step, backend)
        finally:
            plane.run(stream.release(plane.weight_version))

    def settle(self) -> None:
        """Wait for the push in flight; its failure (e.g. the engines refused the weights) is raised here."""
        pushing, self._pushing = self._pushing, None
        if pushing is not None:
            pushing.result()

    def data_state(self) -> tuple[int, list[Prompt]]:
        self.settle()
        return self.c.plane.run(self.stream.snapshot())

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.settle()
            finally:
                self._pusher.shutdown(wait=True)
                self.c.plane.run(self.stream.stop())


class SyncSchedule:
    def __init__(self, c: Step) -> None:
        self.c = c

    def step(self, step: int) -> dict[str, float]:
        return sync_step(self.c, step)

    def settle(self) -> None:
        pass

    def data_state(self) -> tuple[int, list[Prompt]]:
        """The data's position and the prompts to serve first (see :meth:`GroupStream.snapshot`)."""
        return self.c.data.position, list(self.c.data.requeued)

    def close(self) -> None:
        pass


def stream_settings(config: Any) -> StreamSettings:
    """``rollout.async`` as settings; ``update`` defaults to ``abort`` with ``rollout.partial_rollout`` (aborted
    samples keep their tokens and continue), else to ``pause``."""
    node = config.rollout["async"]
    update = node["update"] or ("abort" if config.rollout.partial_rollout else "pause")  # node.update: dict's method
    return StreamSettings(max_staleness=node.max_staleness, max_concurrent_samples=node.max_concurrent_samples,
                          stale=node.stale, update=update)


def make_schedule(name: str, c: Step, settings: StreamSettings, version: int) -> Any:
    """The schedule ``name`` over the components; the stream starts generating at once."""
    if name == "sync":
        return SyncSchedule(c)
    if name == "one_step_off":
        settings = replace(settings, max_staleness=1, whole_steps=True)
    return StreamSchedule(c, settings, version)
