"""The core loop: one RL step, one SFT step, one evaluation. Every stage goes through its plugin.

The components (engine, backend, reward ...) are assembled by :mod:`miles.run.runner`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from statistics import fmean
from typing import Any, Callable

import torch

from miles import interrupts
from miles.agentic.metrics import agentic_metrics
from miles.loop.distill import distill_advantages
from miles.errors import DataError, RunError
from miles.rollout.context import RolloutContext
from miles.rollout.data_source import Prompt, PromptSource
from miles.rollout.generate import make_groups, run_rollouts
from miles.rewards.scoring import score_samples
from miles.train.regularizers import kl_estimate
from miles.types import Group, Sample, SampleStatus, TrainBatch

__all__ = ["Components", "rl_step", "sft_step", "evaluate", "rollout_metrics", "train_groups", "push_weights", "finish_step", "check_failures"]


@dataclass
class Components:
    """Everything a step needs, built from the config by the runner."""

    pm: Any
    train_data: PromptSource
    rollout_fn: Callable
    rollout_ctx: RolloutContext
    plane: Any  # miles.rollout.plane.RolloutPlane
    reward_fn: Callable
    collector: Any  # miles.rollout.collect.GroupCollector: rounds, selectors, buffer
    advantage_fn: Callable
    loss_fn: Callable
    backend: Any
    transport: Any
    pad_token_id: int
    prompts_per_step: int
    n_samples: int
    max_failed_frac: float
    mask_off_policy: bool = False  # zero the loss mask of tokens an older policy sampled
    kl_reward_coef: float = 0.0  # KL to the reference policy as a per-sequence reward penalty
    kl_estimator: str = "k3"
    release_memory: bool = False  # engines free their memory while the trainer trains (a colocated trainer)
    teacher: Any = None  # miles.loop.distill.Teacher: on-policy distillation's per-token advantages
    router_stats_seen: dict[str, int] = field(default_factory=dict)
    # run.save_rollouts: called with each step's training samples before they train (miles.loop.saved_rollouts)
    save_rollouts: Callable[[int, list[Sample]], None] | None = None
    rollout_only: bool = False  # run.rollout_only: generate, score and select; train and push nothing


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


def rl_step(c: Components, step: int) -> dict[str, float]:
    """One synchronous step: generate and select the step's groups, train on them, push the new weights."""
    start = time.perf_counter()
    failed: list[int] = []

    def check(samples: list[Sample]) -> None:
        failed.append(check_failures(step, samples, c.max_failed_frac))

    prefill_before = c.plane.prefill_counts()
    collected = c.collector.collect(c.train_data, c.rollout_fn, c.rollout_ctx, c.reward_fn, check)
    metrics = rollout_metrics(c, collected, time.perf_counter() - start, prefill_before, sum(failed))
    c.pm.hook.miles_rollout_end(step=step, groups=collected.groups)
    push = lambda: push_weights(c, step)  # noqa: E731
    if c.release_memory and any(g.trainable_samples for g in collected.groups):  # else nothing is pushed
        c.plane.post_all("/release_memory_occupation", {"tags": None})  # SGLang: weights, KV cache, CUDA graphs
        push = lambda: _resume_and_push(c, step)  # noqa: E731
    train_groups(c, step, collected.groups, metrics, push)
    return finish_step(c, metrics, start)


def _resume_and_push(c: Components, step: int) -> None:
    """Engines that released their memory for training: weights back first (to receive the push), then the cache."""
    c.plane.post_all("/resume_memory_occupation", {"tags": ["weights"]})
    push_weights(c, step)
    c.plane.post_all("/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})


def rollout_metrics(c: Components, collected: Any, rollout_s: float, prefill_before: tuple[int, int],
                    failed: int, prefill_after: tuple[int, int] | None = None) -> dict[str, float]:
    """The rollout side of a step's metrics: ``collected.samples`` are the samples generated for it (each
    counted once), ``collected.groups`` those kept for training; ``rollout_s`` the time the step waited for them.
    ``prefill_before``/``_after``: the engines' prefill counts around the generation (after: now, by default)."""
    samples = collected.samples
    # Prompt tokens this step's requests asked the engines to prefill, and those their prefix caches spared.
    after = prefill_after if prefill_after is not None else c.plane.prefill_counts()
    requested, computed = (max(0, a - b) for a, b in zip(after, prefill_before))
    rewarded = [s for s in samples if s.trainable]
    response_tokens = sum(len(s.response_ids) for s in samples)
    return {
        "reward/mean": fmean(s.scalar_reward for s in rewarded) if rewarded else float("nan"),
        "response/length_mean": fmean(len(s.response_ids) for s in samples) if samples else 0.0,
        "rollout/truncated_frac": (sum(s.status is SampleStatus.TRUNCATED for s in samples) / len(samples)
                                   if samples else 0.0),
        "samples/total": len(samples),
        "samples/failed": failed,
        **collected.metrics,
        "time/rollout_s": rollout_s,
        "rollout/tokens_per_s": response_tokens / rollout_s if rollout_s > 0 else 0.0,
        "rollout/prefix_hit_frac": 1.0 - computed / requested if requested else 0.0,
        **agentic_metrics(samples),
    }


def push_weights(c: Components, step: int, backend: Any = None) -> None:
    """Send the weights trained at ``step`` (``backend``'s, by default ``c.backend``'s) to the engines as
    version ``step + 1``."""
    try:
        c.transport.push(backend or c.backend, c.plane, version=step + 1)
    except ValueError as exc:  # refused by the engines, e.g. NaN weights after a diverged step
        raise RunError(f"step {step}: the engines refused the new weights (version {step + 1}); they keep "
                       f"serving version {c.plane.weight_version}. {exc}") from exc


def train_groups(c: Components, step: int, groups: list[Group], metrics: dict[str, float],
                 push: Callable[[], None]) -> bool:
    """Train on ``groups`` (advantages, the loss, one optimizer step) and ``push`` the new weights; adds the
    training side of the step's metrics to ``metrics``. Nothing trained (or ``rollout_only``), nothing pushed;
    returns whether it pushed."""
    train_samples = [s for g in groups for s in g.trainable_samples]
    # rollout.tito.on_mismatch=split: a trajectory's earlier parts train as rows of their own, after its rows
    owners = [(i, seg) for i, s in enumerate(train_samples) for seg in s.segments]
    for i, segment in owners:
        segment.reward = train_samples[i].reward
    rows = train_samples + [seg for _, seg in owners]
    if c.mask_off_policy:
        for sample in rows:
            sample.mask_off_policy()
    if c.save_rollouts is not None:  # before training: a step that fails to train is kept to replay
        c.save_rollouts(step, train_samples)
    train_s = sync_s = logprob_s = advantage_s = 0.0
    trains = bool(train_samples) and not c.rollout_only
    if trains:
        logprob_start = time.perf_counter()  # the forward passes before the update: reference, values, teacher
        batch = TrainBatch.from_samples(rows, c.pad_token_id)
        if c.kl_reward_coef:
            kl = kl_estimate(batch.rollout_logprobs, c.backend.ref_logprobs(batch), c.kl_estimator) * batch.loss_mask
            batch.kl_penalty = c.kl_reward_coef * kl
            metrics["rollout/kl_penalty_mean"] = float(batch.kl_penalty.sum(dim=1).mean())
        if getattr(c.advantage_fn, "needs_values", False):
            batch.values = c.backend.compute_values(batch)
        teacher_logprobs = c.teacher.logprobs(batch) if c.teacher is not None else None
        advantage_start = time.perf_counter()
        logprob_s = advantage_start - logprob_start
        batch.advantages = segment_advantages(batch, c.advantage_fn, [i for i, _ in owners]) if owners else \
            c.advantage_fn(batch)
        if teacher_logprobs is not None:  # on-policy distillation: the teacher's per-token reverse KL
            batch.advantages, distilled = distill_advantages(batch, teacher_logprobs, c.teacher.kl_coef,
                                                             c.teacher.reward_coef)
            metrics.update(distilled)
        metrics["train/nonzero_adv_frac"] = float((batch.advantages.abs().sum(dim=1) > 0).float().mean())
        train_start = time.perf_counter()
        advantage_s = train_start - advantage_start
        metrics.update(c.backend.train_step(batch, c.loss_fn))
        train_s = time.perf_counter() - train_start
        sync_start = time.perf_counter()
        push()
        sync_s = time.perf_counter() - sync_start
        metrics["train/tokens_per_s"] = int(batch.attention_mask.sum()) / train_s
    else:
        metrics["train/tokens_per_s"] = 0.0
    metrics["train/samples"] = len(rows)
    metrics["time/train_s"] = train_s
    metrics["time/logprob_s"] = logprob_s
    metrics["time/advantage_s"] = advantage_s
    metrics["time/weight_sync_s"] = sync_s
    return trains


def segment_advantages(batch: TrainBatch, advantage_fn: Callable, owners: list[int]) -> torch.Tensor:
    """Advantages when trajectories were split (``rollout.tito.on_mismatch=split``): the estimator sees one row
    per trajectory (its last part, the first rows of ``batch``), so groups count each trajectory once; the
    rows of earlier parts (after those, ``owners[j]``: the trajectory of part ``j``) take their trajectory's
    mean advantage over its loss tokens on every loss token of their own."""
    n = len(batch) - len(owners)
    trajectories = batch.select(list(range(n)))
    advantages = torch.zeros_like(batch.loss_mask)
    own = advantage_fn(trajectories)
    advantages[:n, : own.shape[1]] = own
    mask = trajectories.loss_mask
    means = (own * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    for j, owner in enumerate(owners):
        advantages[n + j] = means[owner] * batch.loss_mask[n + j]
    return advantages


def finish_step(c: Components, metrics: dict[str, float], start: float) -> dict[str, float]:
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
    metrics["time/step_s"] = time.perf_counter() - start
    interrupts.check()  # a SIGINT/SIGTERM whose exception was swallowed stops the run here
    return metrics


def sft_samples(prompts: list[Prompt], tokenizer: Any, messages_key: str | None = None,
                chat_format: Any = None) -> list[Sample]:
    """Prompt/label pairs as samples whose response is the label followed by EOS; with ``messages_key``,
    the conversation in that column of each row instead (:func:`conversation_sample`, rendered in
    ``chat_format`` when given, else in the builtin format the tokenizer speaks)."""
    if messages_key:
        return [conversation_sample(p, chat_format or tokenizer, p.extra.get(messages_key), messages_key)
                for p in prompts]
    samples = []
    for prompt in prompts:
        sample = Sample(prompt_ids=list(prompt.prompt_ids), prompt=prompt.prompt, label=prompt.label, reward=0.0)
        label_ids = tokenizer(str(prompt.label), add_special_tokens=False)["input_ids"]
        sample.append([*label_ids, tokenizer.eos_token_id], None, from_policy=True)
        sample.status = SampleStatus.COMPLETED
        samples.append(sample)
    return samples


def conversation_sample(prompt: Prompt, tokenizer: Any, messages: Any, key: str = "messages") -> Sample:
    """A multi-turn SFT sample, token for token as ``multi_turn`` would record it: the prompt through the
    chat template, each assistant message's ``content`` as the exact text the policy generates (tool calls
    written inline, as the tool parser reads them) plus the end-of-turn token (loss mask 1), the other
    messages as the template's suffix (loss mask 0)."""
    from miles.agentic.chat import Conversation, normalize_messages

    if not isinstance(messages, list) or not messages:
        raise DataError(f"row {prompt.index}: sft.messages_key {key!r} must hold a non-empty list of messages")
    first = normalize_messages(prompt.prompt, role="user")
    conversation = Conversation(tokenizer, first)
    sample = Sample(prompt_ids=list(conversation.prompt_ids), prompt=prompt.prompt, label=prompt.label, reward=0.0)
    pending: list[dict] = []
    for message in messages:
        if message.get("role") != "assistant":
            pending.append(message)
            continue
        if pending:
            sample.append(conversation.extend(pending), None, from_policy=False)
            pending = []
        text = str(message.get("content") or "")
        sample.append(conversation.encode(text) + [conversation.eot_id], None, from_policy=True)
        conversation.add_policy_turn({"role": "assistant", "content": text})
    sample.status = SampleStatus.COMPLETED
    return sample


def sft_step(data: PromptSource, tokenizer: Any, batch_size: int, backend: Any, loss_fn: Callable, pad_token_id: int,
             messages_key: str | None = None, chat_format: Any = None) -> dict[str, float]:
    start = time.perf_counter()
    batch = TrainBatch.from_samples(sft_samples(data.next(batch_size), tokenizer, messages_key, chat_format),
                                    pad_token_id)
    metrics = backend.train_step(batch, loss_fn)
    metrics["time/step_s"] = time.perf_counter() - start
    interrupts.check()
    return metrics


def evaluate(prompts: list[Prompt], rollout_fn: Callable, ctx: RolloutContext, reward_fn: Callable, pass_reward: float) -> dict[str, float]:
    """Greedy decoding on held-out prompts; failed samples count as unsolved."""
    if not prompts:
        return {}
    groups = make_groups(prompts, 1)
    samples = [g.samples[0] for g in groups]
    run_rollouts(groups, rollout_fn, ctx)
    score_samples(samples, reward_fn)
    rewards = [s.scalar_reward if s.trainable else 0.0 for s in samples]
    return {
        "eval/reward_mean": fmean(rewards),
        "eval/accuracy": fmean(r >= pass_reward for r in rewards),
        "eval/failed": sum(not s.trainable for s in samples),
    }
