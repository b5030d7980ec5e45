"""The reward stage: plain, async and batched reward functions, each call under the configured time
limit (``reward.timeout_s``), with failures recorded per sample.

A sample whose label the reward cannot score against (a reward with ``label_types``,
:class:`miles.hookspecs.NeedsLabel`: none, or of a type it does not compare) fails without a call.

Under a limit, a plain (sync) reward runs in a daemon thread, one sample at a time, so that a call
that never returns can be abandoned. Python cannot kill a thread: an abandoned one is left behind,
and as a daemon it does not hold up the exit of the process. One sample after another, a reward that
hangs would cost its limit once per sample (128 samples at 1 s: minutes per step); so once
:data:`HUNG_AFTER` calls in a row have run past the limit, the reward is taken as hung and the rest of
the samples fail unscored, with a reason naming it. The step's ``run.max_failed_frac`` then
decides whether the run stops. Async rewards run every sample's limit at once, a batched one has one.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from miles import interrupts
from miles.interrupts import TimedOut, failure_reason, time_limit, within
from miles.rewards.labels import declared_label_types, is_empty_label, label_problem, show_label
from miles.types import Sample

__all__ = ["HUNG_AFTER", "max_abs_reward", "reward_name", "score_samples", "score_samples_async"]

HUNG_AFTER = 3  # calls of a plain reward in a row past its time limit that make it hung: the rest are not scored


def _is_async(fn: Callable) -> bool:
    target = getattr(fn, "func", fn)  # functools.partial
    return inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(getattr(target, "__call__", None))


def reward_name(reward_fn: Callable) -> str:
    """What failure reasons call a reward: its ``miles_name`` when set, else the name of the function or class
    under the stage's wrappers (``functools.partial``)."""
    obj = reward_fn
    while True:
        if getattr(obj, "miles_name", None):
            return str(obj.miles_name)
        if not isinstance(obj, functools.partial):
            break
        obj = obj.func
    return getattr(obj, "__name__", None) or type(obj).__name__


def _reason(exc: Exception, name: str) -> str:
    """Why a call failed; a time-out names the reward (the reason still starts "reward: timed out", as counted)."""
    if isinstance(exc, TimedOut):
        return f"reward: {exc} (reward {name!r}, reward.timeout_s)"
    return failure_reason("reward", exc)


def _without_labels(samples: list[Sample], reward_fn: Callable) -> list[Sample]:
    """Fail the samples whose label the reward cannot score against (it declares ``label_types``); the others."""
    types = declared_label_types(reward_fn)
    if types is None:
        return samples
    scorable = []
    for sample in samples:
        problem = label_problem(sample.label, types)
        if problem is None:
            scorable.append(sample)
        elif is_empty_label(sample.label):
            empty = "" if sample.label is None else f", only {show_label(sample.label)}"
            sample.fail(f"reward: the sample has no label (data.label_key{empty}), which reward "
                        f"{reward_name(reward_fn)!r} scores the response against")
        else:
            sample.fail(f"reward: reward {reward_name(reward_fn)!r} cannot score against the sample's label: {problem}")
    return scorable


def max_abs_reward(reward_fn: Callable) -> float | None:
    """The largest reward magnitude a sample may have (``reward.max_abs``, marked on the stage's wrapper by
    :meth:`miles.config.prepared.Prepared.build`); None for a reward called without it (no bound but finiteness)."""
    return getattr(reward_fn, "miles_max_abs", None)


def _check(sample: Sample, value: Any, reward_fn: Callable) -> None:
    """Record a reward, or fail the sample if it is not a finite number (or dict with a finite score) within
    ``reward.max_abs``: a reward near float's range (1e308) turns the group's advantages, the loss and then the
    weights into NaN, and the run would stop at the weight push naming the weights, not the reward."""
    score = value.get("score") if isinstance(value, dict) else value
    if isinstance(value, dict) and "score" not in value:
        sample.fail(f"reward: returned a dict without a 'score' entry (keys: {', '.join(map(str, value))})")
        return
    if isinstance(score, bool) or not isinstance(score, (int, float)):
        sample.fail(f"reward: returned {type(score).__name__} {score!r}, expected a number")
        return
    extras = {k: _as_float(v) for k, v in value.items()} if isinstance(value, dict) else {}
    if (bad := next((k for k, v in extras.items() if v is None), None)) is not None:
        shown = repr(value[bad]) if not isinstance(value[bad], int) else f"of {value[bad].bit_length()} bits"
        sample.fail(f"reward: returned a dict whose {bad!r} entry is {type(value[bad]).__name__} {shown}, expected a "
                    f"number (a float holds it)")
        return
    if isinstance(score, int) and abs(score) > sys.float_info.max:
        sample.fail(f"reward: reward {reward_name(reward_fn)!r} returned an integer too large for a float "
                    f"({score.bit_length()} bits)")
        return
    if not math.isfinite(score):
        sample.fail(f"reward: reward {reward_name(reward_fn)!r} returned a non-finite value {score!r}")
        return
    bound = max_abs_reward(reward_fn)
    if bound is not None and abs(score) > bound:
        sample.fail(f"reward: reward {reward_name(reward_fn)!r} returned {score!r}, beyond reward.max_abs={bound:g} "
                    f"(a reward that large overflows the advantages and the loss; raise reward.max_abs if it is "
                    f"meant)")
        return
    sample.reward = extras if isinstance(value, dict) else float(score)


def _as_float(value: Any) -> float | None:
    """A reward dict's entry as a float (a bool counts); None when it is no number or too large for a float."""
    if not isinstance(value, (bool, int, float)):
        return None
    try:
        return float(value)
    except OverflowError:  # an int beyond float's range
        return None


def score_samples(samples: list[Sample], reward_fn: Callable) -> None:
    """Set ``reward`` on every trainable sample in place; a reward that raises or runs past its time
    limit fails only its sample (a batched one, every sample of the batch)."""
    interrupts.run(score_samples_async(samples, reward_fn))


async def score_samples_async(samples: list[Sample], reward_fn: Callable) -> None:
    """:func:`score_samples` inside a running event loop."""
    todo = _without_labels([s for s in samples if s.trainable], reward_fn)
    if not todo:
        return
    if getattr(getattr(reward_fn, "func", reward_fn), "miles_batched", False):
        await _score_batch(todo, reward_fn)
    elif _is_async(reward_fn):
        await asyncio.gather(*(_score_one(s, reward_fn) for s in todo))
    elif time_limit(reward_fn) is None:
        for sample in todo:  # one at a time, as a plain function expects
            await _score_one(sample, reward_fn)
    else:
        await _score_plain_limited(todo, reward_fn, time_limit(reward_fn))


async def _score_plain_limited(samples: list[Sample], reward_fn: Callable, timeout_s: float) -> None:
    """A plain reward, one sample after another on a daemon worker thread (:class:`_PlainCalls`). A call past the
    limit fails its sample; that thread is left behind (Python cannot kill it) and a new one scores the rest,
    unless :data:`HUNG_AFTER` calls in a row ran past it: then the rest fail unscored."""
    name, streak = reward_name(reward_fn), 0
    while samples:
        if streak >= HUNG_AFTER:
            for sample in samples:
                sample.fail(f"reward: not scored: reward {name!r} looks hung (its last {streak} calls in a row ran "
                            f"past reward.timeout_s={timeout_s:g} s)")
            return
        calls = _PlainCalls(reward_fn, samples)
        todo, samples = samples, []
        try:
            for i, sample in enumerate(todo):
                outcome = await calls.result(i, timeout_s)
                if outcome is None:  # past the limit
                    sample.fail(_reason(TimedOut(f"timed out after {timeout_s:g} s"), name))
                    streak += 1
                    samples = todo[i + 1:]
                    break
                value, error = outcome
                awaitable = error is None and _awaitable(value)
                if awaitable:
                    try:
                        value = await within(timeout_s, value)
                    except Exception as exc:
                        error = exc
                streak = streak + 1 if isinstance(error, TimedOut) else 0
                if error is not None:
                    sample.fail(_reason(error, name))
                else:
                    _check(sample, value, reward_fn)
                if streak >= HUNG_AFTER:  # awaitables past the limit: the thread is free, the reward still hung
                    samples = todo[i + 1:]
                    break
                if awaitable:
                    calls.taken()
        finally:  # the thread stops before its next call (after the one it is in, if that ever returns)
            calls.abandon()


class _PlainCalls:
    """A daemon thread calling a plain reward on ``samples`` in order, each call as soon as the last returned: no
    round trip to the event loop per sample, which cost more than a cheap reward itself (16 ms a step of 128
    exact-match samples). The event loop reads the outcomes in order and is woken only when it waits for one.

    After an outcome that is an awaitable, the thread waits until the loop has awaited it (:meth:`taken`): a plain
    reward handing out awaitables runs one at a time, so a hung one is called :data:`HUNG_AFTER` times, no more.
    Once abandoned the thread starts no new call, so no sample is scored twice."""

    def __init__(self, reward_fn: Callable, samples: list[Sample]) -> None:
        self._loop = asyncio.get_running_loop()
        self._lock = threading.Lock()
        self._outcomes: list[tuple[Any, Exception | None]] = []
        self._calling = -1  # the index of the call the thread is in (or has finished last)
        self._call_start = 0.0  # when that call started
        self._waiter: asyncio.Future | None = None
        self._abandoned = False
        self._awaited = threading.Semaphore(0)
        _in_daemon(functools.partial(self._work, reward_fn, samples))

    def _work(self, reward_fn: Callable, samples: list[Sample]) -> None:
        for n, sample in enumerate(samples):
            with self._lock:
                if self._abandoned:
                    return
                self._calling, self._call_start = n, time.monotonic()
            try:
                outcome = (reward_fn(sample), None)
            except Exception as exc:  # recorded on the sample by the waiting side
                outcome = (None, exc)
            with self._lock:
                self._outcomes.append(outcome)
                waiter, self._waiter = self._waiter, None
            if waiter is not None:
                try:
                    self._loop.call_soon_threadsafe(_wake, waiter)
                except RuntimeError:  # the event loop is closed: nobody waits any more
                    return
            if _awaitable(outcome[0]):
                self._awaited.acquire()

    async def result(self, i: int, timeout_s: float) -> tuple[Any, Exception | None] | None:
        """The outcome of call ``i`` (``(value, error)``), or None once it ran past ``timeout_s``: the thread is
        then abandoned."""
        while True:
            with self._lock:
                if len(self._outcomes) > i:
                    return self._outcomes[i]
                # a call not started yet (its thread between two calls) has its whole limit ahead
                start = self._call_start if self._calling >= i else time.monotonic()
                remaining = start + timeout_s - time.monotonic()
                if remaining <= 0:
                    self._abandoned = True
                    return None
                self._waiter = waiter = self._loop.create_future()
            try:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancellation (Ctrl-C in
                # asyncio.run) that arrives just as the result does, and the run would not stop
                async with asyncio.timeout(remaining):
                    await waiter
            except TimeoutError:
                pass

    def taken(self) -> None:
        """The loop has awaited the awaitable the last call returned: the next call may start."""
        self._awaited.release()

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True
        self._awaited.release()


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


async def _score_one(sample: Sample, reward_fn: Callable) -> None:
    try:
        value = await _call(reward_fn, sample)
    except Exception as exc:
        sample.fail(_reason(exc, reward_name(reward_fn)))
        return
    _check(sample, value, reward_fn)


async def _score_batch(samples: list[Sample], reward_fn: Callable) -> None:
    try:
        values = list(await _call(reward_fn, samples))
        if len(values) != len(samples):
            raise ValueError(f"returned {len(values)} rewards for {len(samples)} samples")
    except Exception as exc:
        for sample in samples:
            sample.fail(_reason(exc, reward_name(reward_fn)))
        return
    for sample, value in zip(samples, values):
        _check(sample, value, reward_fn)


async def _call(reward_fn: Callable, arg: Any) -> Any:
    """``reward_fn(arg)``, awaited if it returns an awaitable, under the reward's time limit."""
    timeout_s = time_limit(reward_fn)

    async def call() -> Any:
        in_thread = timeout_s is not None and not _is_async(reward_fn)
        value = await _in_daemon_thread(reward_fn, arg) if in_thread else reward_fn(arg)
        return await value if inspect.isawaitable(value) else value

    return await within(timeout_s, call())


async def _in_daemon_thread(fn: Callable, arg: Any) -> Any:
    """``fn(arg)`` in a new daemon thread; when the caller stops waiting, the thread runs on unwatched."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if done.done():  # the caller gave up waiting
            return
        if error is None:
            done.set_result(value)
        else:
            done.set_exception(error)

    def work() -> None:
        try:
            outcome = (fn(arg), None)
        except BaseException as exc:  # noqa: BLE001 - handed over to the waiting caller
            outcome = (None, exc)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the event loop is closed: nobody waits any more
            pass

    _in_daemon(work)
    return await done


def _awaitable(value: Any) -> bool:
    """``inspect.isawaitable``, without its abstract-class check for the plain values most rewards return."""
    return type(value) not in (float, int, bool, dict) and inspect.isawaitable(value)


_idle: list[queue.SimpleQueue] = []  # the job queues of daemon threads waiting for work
_idle_lock = threading.Lock()


def _in_daemon(job: Callable[[], None]) -> None:
    """Run ``job`` on a daemon thread: one that waits idle since its last job, else a new one. A thread goes back
    to waiting once its job returns, so a job stuck in a hung call holds only its own thread. (Starting a thread
    per job waits for it to start, which under a busy interpreter lock costs milliseconds.)"""
    with _idle_lock:
        jobs = _idle.pop() if _idle else None
    if jobs is None:
        jobs = queue.SimpleQueue()
        threading.Thread(target=_serve_jobs, args=(jobs,), name="miles-reward", daemon=True).start()
    jobs.put(job)


def _serve_jobs(jobs: queue.SimpleQueue) -> None:
    while True:
        job = jobs.get()
        try:
            job()
        except BaseException:  # noqa: BLE001 - a job reports its own failures; the thread must go on serving
            pass
        del job  # nothing of the last job is kept alive while the thread waits
        with _idle_lock:
            _idle.append(jobs)
