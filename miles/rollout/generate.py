"""Running a rollout function over every sample of a step, concurrently, each under the configured
time limit (``rollout.fn.timeout_s``; the reward stage shares the limit helpers)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import TypeVar

from miles import interrupts
from miles.rollout.context import RolloutContext
from miles.rollout.data_source import Prompt
from miles.engine.router import NoEngineLeft
from miles.types import Group, Sample, SampleStatus

__all__ = [
    "TimedOut", "failure_reason", "make_groups", "run_one", "run_rollouts", "time_limit", "with_time_limit", "within",
]

T = TypeVar("T")


class TimedOut(Exception):
    """A user function ran past its configured time limit."""


def with_time_limit(fn: Callable, timeout_s: float) -> Callable:
    """``fn``, marked to run under a limit of ``timeout_s`` seconds (0: none) by the rollout and reward
    stages. The mark is on a new wrapper (``.func`` is ``fn``), never on ``fn`` itself."""
    limited = functools.partial(fn)
    limited.miles_timeout_s = float(timeout_s)  # type: ignore[attr-defined]
    return limited


def time_limit(fn: Callable) -> float | None:
    """The limit :func:`with_time_limit` put on ``fn``, in seconds; None for no limit."""
    return getattr(fn, "miles_timeout_s", 0.0) or None


def failure_reason(stage: str, exc: Exception) -> str:
    """Why a sample failed: ``stage: timed out after N s``, or ``stage: ErrorType: message``."""
    return f"{stage}: {exc}" if isinstance(exc, TimedOut) else f"{stage}: {type(exc).__name__}: {exc}"


async def within(timeout_s: float | None, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable``; past ``timeout_s`` seconds (None: no limit) it is cancelled and TimedOut raised.
    A TimeoutError that the awaitable raises itself passes through unchanged."""
    limit = asyncio.timeout(timeout_s)
    try:
        async with limit:
            return await awaitable
    except TimeoutError:
        if limit.expired():
            raise TimedOut(f"timed out after {timeout_s:g} s") from None
        raise


def make_groups(prompts: list[Prompt], n_samples: int, first_group_index: int = 0) -> list[Group]:
    return [
        Group(
            index=first_group_index + g,
            samples=[
                Sample(
                    prompt_ids=list(p.prompt_ids), group_index=first_group_index + g, index=i,
                    prompt=p.prompt, label=p.label, metadata={"row": p.index, "data": p.extra},
                )
                for i in range(n_samples)
            ],
        )
        for g, p in enumerate(prompts)
    ]


async def run_one(rollout_fn: Callable, sample: Sample, ctx: RolloutContext) -> None:
    try:
        result = await within(time_limit(rollout_fn), rollout_fn(sample, ctx))
    except NoEngineLeft:  # not this sample's failure: the run cannot go on
        raise
    except Exception as exc:  # one sample fails, the step goes on
        sample.fail(failure_reason("rollout", exc))
        return
    if result is not sample:
        sample.fail(f"rollout: the rollout function returned {type(result).__name__}, expected the sample it was given")
    elif sample.status is SampleStatus.PENDING:
        sample.fail("rollout: the rollout function left the sample pending")


def run_rollouts(groups: list[Group], rollout_fn: Callable, ctx: RolloutContext) -> None:
    """Fill every sample of ``groups`` in place; failures are recorded on the samples.

    The rollouts run on ``ctx.run`` (the rollout plane's event loop) when set, else on a fresh loop.
    """

    async def _all() -> None:
        await asyncio.gather(*(run_one(rollout_fn, s, ctx) for g in groups for s in g.samples))

    (ctx.run or interrupts.run)(_all())
