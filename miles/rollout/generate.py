"""Running a rollout function over every sample of a step, concurrently, each under the configured
time limit (``rollout.fn.timeout_s``, :func:`miles.interrupts.within`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from miles import interrupts
from miles.interrupts import failure_reason, time_limit, within
from miles.rollout.context import RolloutContext
from miles.rollout.data_source import Prompt
from miles.engine.router import NoEngineLeft
from miles.types import Group, Sample, SampleStatus

__all__ = ["make_groups", "run_one", "run_rollouts"]


def make_groups(prompts: list[Prompt], n_samples: int, first_group_index: int = 0) -> list[Group]:
    return [
        Group(
            index=first_group_index + g,
            samples=[
                Sample(
                    prompt_ids=list(p.prompt_ids), group_index=first_group_index + g, index=i,
                    prompt=p.prompt, label=p.label, metadata={"row": p.index, "data": p.extra}, images=list(p.images),
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
