"""The reward stage: plain, async and batched reward functions, with failures recorded per sample."""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable
from typing import Any

from miles.types import Sample

__all__ = ["score_samples"]


def _is_async(fn: Callable) -> bool:
    target = getattr(fn, "func", fn)  # functools.partial
    return inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(getattr(target, "__call__", None))


def _check(sample: Sample, value: Any) -> None:
    """Record a reward, or fail the sample if it is not a finite number (or dict with a finite score)."""
    score = value.get("score") if isinstance(value, dict) else value
    if isinstance(value, dict) and "score" not in value:
        sample.fail(f"reward: returned a dict without a 'score' entry (keys: {', '.join(map(str, value))})")
        return
    if isinstance(score, bool) or not isinstance(score, (int, float)):
        sample.fail(f"reward: returned {type(score).__name__} {score!r}, expected a number")
        return
    if not math.isfinite(score):
        sample.fail(f"reward: returned a non-finite value {score!r}")
        return
    sample.reward = {k: float(v) for k, v in value.items()} if isinstance(value, dict) else float(score)


def score_samples(samples: list[Sample], reward_fn: Callable) -> None:
    """Set ``reward`` on every trainable sample in place; a raising reward fails only its sample."""
    target = getattr(reward_fn, "func", reward_fn)
    if getattr(target, "miles_batched", False) or _is_async(reward_fn):
        asyncio.run(score_samples_async(samples, reward_fn))
        return
    _score_each([s for s in samples if s.trainable], reward_fn)


def _score_each(samples: list[Sample], reward_fn: Callable) -> None:
    for sample in samples:
        try:
            value = reward_fn(sample)
        except Exception as exc:
            sample.fail(f"reward: {type(exc).__name__}: {exc}")
            continue
        _check(sample, value)


async def score_samples_async(samples: list[Sample], reward_fn: Callable) -> None:
    """:func:`score_samples` inside a running event loop."""
    todo = [s for s in samples if s.trainable]
    if not todo:
        return
    target = getattr(reward_fn, "func", reward_fn)
    if getattr(target, "miles_batched", False):
        try:
            values = reward_fn(todo)
            if inspect.isawaitable(values):
                values = await values
            values = list(values)
            if len(values) != len(todo):
                raise ValueError(f"returned {len(values)} rewards for {len(todo)} samples")
        except Exception as exc:
            for sample in todo:
                sample.fail(f"reward: {type(exc).__name__}: {exc}")
            return
        for sample, value in zip(todo, values):
            _check(sample, value)
        return
    if _is_async(reward_fn):
        await _score_async(todo, reward_fn)
        return
    _score_each(todo, reward_fn)


async def _score_async(samples: list[Sample], reward_fn: Callable) -> None:
    async def one(sample: Sample) -> None:
        try:
            value = await reward_fn(sample)
        except Exception as exc:
            sample.fail(f"reward: {type(exc).__name__}: {exc}")
            return
        _check(sample, value)

    await asyncio.gather(*(one(s) for s in samples))
