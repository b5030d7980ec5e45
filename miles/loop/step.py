"""The stages of one RL step, which every schedule composes: collect -> learn -> push.

:class:`Step` is what a step runs on, assembled by :mod:`miles.run.rl`: the rollout side (data, rollout
function and its context, reward, collector, the rollout plane), the :class:`~miles.loop.learner.Learner`,
the weight transport and the plugins' hooks. Every stage goes through its plugin.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import fmean
from typing import Any

from miles import interrupts
from miles.agentic.metrics import agentic_metrics
from miles.errors import RunError
from miles.hookspecs import ReportingTransport
from miles.loop.learner import Learner
from miles.rollout.collect import Collected, GroupCollector
from miles.rollout.context import RolloutContext
from miles.rollout.data_source import PromptSource
from miles.rollout.plane import RolloutPlane
from miles.types import Sample, SampleStatus

__all__ = ["Step", "check_failures", "finish_step", "push_weights", "rollout_metrics", "sync_step"]


@dataclass
class Step:
    hooks: Any  # the plugin manager's hook relay (miles_rollout_end)
    data: PromptSource
    rollout_fn: Callable[..., Any]
    ctx: RolloutContext
    reward_fn: Callable[..., Any]
    collector: GroupCollector  # rounds, selectors, buffer
    plane: RolloutPlane
    learner: Learner
    transport: Any  # a weight transport (miles.hookspecs.miles_register_weight_transports)
    max_failed_frac: float
    release_memory: bool = False  # engines free their memory while the trainer trains (a colocated trainer)
    router_stats_seen: dict[str, int] = field(default_factory=dict)
    draft: Any = None  # a DraftLearner (miles.loop.draft): the speculative draft learns each step's rollouts

    @property
    def n_samples(self) -> int:
        return self.collector.n_samples

    @property
    def prompts_per_step(self) -> int:
        return self.collector.prompts_per_step


def check_failures(step: int, samples: list[Sample], max_failed_frac: float) -> int:
    failed = [s for s in samples if s.status is SampleStatus.FAILED]
    if samples and len(failed) / len(samples) > max_failed_frac:
        reasons = sorted({s.reason for s in failed})
        raise RunError(
            f"step {step}: {len(failed)} of {len(samples)} samples failed "
            f"({len(failed) / len(samples):.0%}), above run.max_failed_frac={max_failed_frac}. "
            f"Reasons: {'; '.join(reasons[:3])}"
        )
    return len(failed)


def sync_step(c: Step, step: int) -> dict[str, float]:
    """One synchronous step: collect the step's groups, learn on them, push the new weights."""
    start = time.perf_counter()
    failed: list[int] = []

    def check(samples: list[Sample]) -> None:
        failed.append(check_failures(step, samples, c.max_failed_frac))

    prefill_before = c.plane.prefill_counts()
    collected = c.collector.collect(c.data, c.rollout_fn, c.ctx, c.reward_fn, check)
    metrics = rollout_metrics(c, collected, time.perf_counter() - start, prefill_before, sum(failed))
    c.hooks.miles_rollout_end(step=step, groups=collected.groups)
    released = c.release_memory and any(g.trainable_samples for g in collected.groups)  # else nothing is pushed
    if released:
        c.plane.release_memory()
    sync_s = 0.0
    if c.learner.learn(step, collected.groups, metrics):
        if c.draft is not None:  # towards the policy just learnt, before both are pushed
            metrics.update(c.draft.learn(collected.groups, c.learner.backend))
        sync_start = time.perf_counter()
        if released:  # weights back first (to receive the push), then the cache
            c.plane.resume_memory("weights")
        push_weights(c, step)
        if released:
            c.plane.resume_memory("kv_cache", "cuda_graph")
        sync_s = time.perf_counter() - sync_start
    metrics["time/weight_sync_s"] = sync_s
    return finish_step(c, metrics, start)


def rollout_metrics(c: Step, collected: Collected, rollout_s: float, prefill_before: tuple[int, ...],
                    failed: int, prefill_after: tuple[int, ...] | None = None) -> dict[str, float]:
    """The rollout side of a step's metrics: ``collected.samples`` are the samples generated for it (each
    counted once), ``collected.groups`` those kept for training; ``rollout_s`` the time the step waited for them.
    ``prefill_before``/``_after``: the engines' prefill counts around the generation (after: now, by default)."""
    samples = collected.samples
    # Prompt tokens this step's requests asked the engines to prefill, and those their prefix caches spared.
    after = prefill_after if prefill_after is not None else c.plane.prefill_counts()
    requested, computed, row_forwards, proposed, accepted, spec_tokens = (
        max(0, a - b) for a, b in zip(after, prefill_before))
    trained = [s for g in collected.groups for s in g.trainable_samples]
    finished = [s for s in samples if s.trainable]
    response_tokens = sum(len(s.response_ids) for s in samples)
    return {
        # The batch trained at this step; in a streaming schedule it may hold groups that finished before the
        # step began, so the samples that finished for this step are a figure of their own.
        "reward/mean": fmean(s.scalar_reward for s in trained) if trained else float("nan"),
        "reward/finished_mean": fmean(s.scalar_reward for s in finished) if finished else float("nan"),
        "response/length_mean": fmean(len(s.response_ids) for s in samples) if samples else 0.0,
        **_length_spread(sorted(len(s.response_ids) for s in samples)),
        "rollout/truncated_frac": (sum(s.status is SampleStatus.TRUNCATED for s in samples) / len(samples)
                                   if samples else 0.0),
        "samples/total": len(samples),
        "samples/failed": failed,
        **collected.metrics,
        "time/rollout_s": rollout_s,
        "rollout/tokens_per_s": response_tokens / rollout_s if rollout_s > 0 else 0.0,
        "rollout/prefix_hit_frac": 1.0 - computed / requested if requested else 0.0,
        # speculative decoding (rollout.engine.speculative): proposals kept, tokens per target forward of a row
        **({"rollout/spec_accept_rate": accepted / proposed,
            "rollout/spec_tokens_per_forward": spec_tokens / row_forwards} if proposed else {}),
        **agentic_metrics(samples, c.ctx.sandbox),  # with a sandbox pool's counts
    }


def _length_spread(lengths: list[int]) -> dict[str, float]:
    """The 10th, 50th and 90th percentiles (nearest rank) and the largest of sorted response lengths."""
    if not lengths:
        return {}
    rank = lambda q: lengths[min(len(lengths) - 1, max(0, -(-q * len(lengths) // 100) - 1))]  # noqa: E731
    return {"response/length_p10": rank(10), "response/length_p50": rank(50), "response/length_p90": rank(90),
            "response/length_max": lengths[-1]}


def push_weights(c: Step, step: int, backend: Any = None) -> None:
    """Send the weights trained at ``step`` (``backend``'s, by default the learner's) to the engines as
    version ``step + 1``."""
    try:
        c.transport.push(backend or c.learner.backend, c.plane, version=step + 1)
        if c.draft is not None:  # the draft that learnt this step's rollouts, with the policy it follows
            c.draft.push(c.plane)
    except ValueError as exc:  # refused by the engines, e.g. NaN weights after a diverged step
        raise RunError(f"step {step}: the engines refused the new weights (version {step + 1}); they keep "
                       f"serving version {c.plane.weight_version}. {exc}") from exc


def finish_step(c: Step, metrics: dict[str, float], start: float) -> dict[str, float]:
    """The engines' side of the step's metrics (failures, retries since the last step) and its wall time."""
    metrics["weight_version"] = c.plane.weight_version
    if c.plane.router is not None:  # what happened to the engines since the last step's metrics
        if (error := c.plane.router.no_engine_left()) is not None:  # even if run.max_failed_frac let the step pass
            raise error
        stats, seen = c.plane.router.stats, c.router_stats_seen
        for key in ("engine_failures", "retries", "readmissions", "engines_lost_with_node"):
            metrics[f"rollout/{key}"] = stats[key] - seen.get(key, 0)
            seen[key] = stats[key]
        metrics["rollout/engines_in_service"] = len(c.plane.router.healthy)
    if isinstance(c.transport, ReportingTransport):  # e.g. delta pushes, and the engines that needed whole weights
        metrics.update(c.transport.metrics())
    metrics["time/step_s"] = time.perf_counter() - start
    interrupts.check()  # a SIGINT/SIGTERM whose exception was swallowed stops the run here
    return metrics
