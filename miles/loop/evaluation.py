"""Evaluation: greedy accuracy on held-out prompts (:func:`evaluate`), and held-out datasets: ``n`` samples per
prompt at the dataset's sampling parameters, scored by the run's reward, through the run's rollout function
(multi-turn envs included).

Per dataset ``<name>`` (the ``eval`` section, docs/evaluation.md): ``eval/<name>/mean@<n>`` (the mean reward
of all samples), ``eval/<name>/pass@<k>`` for each configured ``k`` (the unbiased estimator of the chance
that at least one of ``k`` samples is correct, from the ``c`` correct of ``n``), the response length, the
truncated and failed shares, the number of prompts, and for multi-turn rollouts the turns and tool calls
(``eval/<name>/turns/mean`` ...).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from statistics import fmean
from typing import Any, Callable

from miles.agentic.metrics import agentic_metrics
from miles.errors import ConfigError
from miles.rollout.context import RolloutContext
from miles.rollout.data_source import Prompt, data_file_problem, encode_rows, read_rows
from miles.rollout.generate import make_groups, run_rollouts
from miles.rewards.scoring import score_samples
from miles.types import SampleStatus

__all__ = ["EvalSet", "evaluate", "evaluate_set", "evaluate_sets", "pass_at_k", "read_eval_sets"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with ``c`` correct samples out of ``n``: ``1 - C(n-c, k) / C(n, k)``
    (the chance that ``k`` samples drawn without replacement from the ``n`` hold a correct one)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass
class EvalSet:
    """One dataset of the ``eval`` section with its prompts encoded."""

    name: str
    prompts: list[Prompt]
    n: int
    k: list[int]
    pass_reward: float
    sampling: dict[str, Any]  # rollout.sampling with the dataset's overrides

    def metric(self, what: str) -> str:
        return f"eval/{self.name}/{what}"


def read_eval_sets(config: Any, tokenizer: Any, eval_path: str | None, context: int,
                   images: Any = None) -> list[EvalSet]:
    """The ``eval.datasets`` of ``config``, read and encoded like the training data (``images``: a vision-language
    model's :class:`miles.models.vision.ImageEncoder`). ``eval_path``: the data's held-out file
    (``data.eval_path`` or the generator's eval split), used by datasets without a path.
    Prompts that leave no room for the dataset's ``max_new_tokens`` are an error naming the dataset."""
    data_cfg, sets = config.data, []
    base_sampling = dict(config.rollout.sampling)
    for i, ds in enumerate(config.eval.datasets):
        where = f"eval.datasets[{i}] ({ds.name})"
        path = ds.path or eval_path
        if not path:
            raise ConfigError(f"{where}.path: no file to evaluate on; set it, or data.eval_path (or a data generator "
                              f"with an eval split) for datasets without a path")
        if problem := data_file_problem(path):
            raise ConfigError(f"{where}.path: {problem}")
        rows = read_rows(path, data_cfg.prompt_key, None, images is not None)
        rows = rows[: ds.max_prompts] if ds.max_prompts else rows
        prompts = encode_rows(rows, tokenizer, prompt_key=data_cfg.prompt_key, label_key=data_cfg.label_key,
                              chat_template=data_cfg.chat_template, images=images)
        sampling = {**base_sampling, **{k: v for k, v in dict(ds.sampling).items() if v is not None}}
        room = int(sampling["max_new_tokens"])
        too_long = [p for p in prompts if len(p.prompt_ids) + room > context]
        if too_long:
            raise ConfigError(f"{where}: {len(too_long)} of {len(prompts)} prompt(s) of {str(path)!r} leave no room "
                              f"for max_new_tokens={room} in the model's context of {context} tokens (row "
                              f"{too_long[0].index + 1} has {len(too_long[0].prompt_ids)} tokens)")
        if not prompts:
            raise ConfigError(f"{where}: {str(path)!r} holds no prompt")
        sets.append(EvalSet(ds.name, prompts, int(ds.n), [int(k) for k in ds.k], float(ds.pass_reward), sampling))
    return sets


def evaluate_set(es: EvalSet, rollout_fn: Callable, ctx: RolloutContext, reward_fn: Callable) -> dict[str, float]:
    """``es.n`` samples of each prompt through ``rollout_fn`` at ``es.sampling``, scored by ``reward_fn``. A
    failed sample counts as incorrect with reward 0."""
    groups = make_groups(es.prompts, es.n)
    run_rollouts(groups, rollout_fn, replace(ctx, sampling_params=dict(es.sampling)))
    samples = [s for g in groups for s in g.samples]
    score_samples(samples, reward_fn)
    metrics = {es.metric(f"mean@{es.n}"): fmean(s.scalar_reward if s.trainable else 0.0 for s in samples)}
    correct = [sum(s.trainable and s.scalar_reward >= es.pass_reward for s in g.samples) for g in groups]
    for k in es.k:
        metrics[es.metric(f"pass@{k}")] = fmean(pass_at_k(es.n, c, k) for c in correct)
    metrics.update({
        es.metric("response_length_mean"): fmean(len(s.response_ids) for s in samples),
        es.metric("truncated_frac"): fmean(s.status is SampleStatus.TRUNCATED for s in samples),
        es.metric("failed"): sum(not s.trainable for s in samples),
        es.metric("prompts"): len(groups),
    })
    metrics.update({es.metric(k): v for k, v in agentic_metrics(samples).items() if k.startswith(("turns/", "tools/"))})
    return metrics


def evaluate_sets(sets: list[EvalSet], rollout_fn: Callable, ctx: RolloutContext,
                  reward_fn: Callable) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for es in sets:
        metrics.update(evaluate_set(es, rollout_fn, ctx, reward_fn))
    return metrics


def evaluate(prompts: list[Prompt], rollout_fn: Callable, ctx: RolloutContext, reward_fn: Callable,
             pass_reward: float) -> dict[str, float]:
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
