"""Builtin data selectors, applied in the order listed under ``selection`` (see docs/algorithms/selection.md).

A selector is ``fn(groups) -> groups to keep``. A class-based selector may also shape how a step
collects its groups, through attributes the loop reads (:mod:`miles.rollout.collect`):
``extra_rounds`` (generate again while the batch is short), ``prompts_factor`` (generate more
prompts than the batch needs), ``buffer_policy`` (keep surplus groups for later steps),
``choose_prompts(data, count)`` (pick the prompts instead of taking the data in order),
``metrics()`` (figures for the step's metrics line) and ``state_dict()``/``load_state_dict()``
(saved in checkpoints).
"""

from __future__ import annotations

import math
import random
from typing import Any

from miles import hookimpl
from miles.rollout.oversampling import OverSampling
from miles.types import Group

__all__ = ["drop_equal_rewards", "DynamicSampling", "OverSampling", "OverlongPenalty", "Buffer", "Curriculum"]


def drop_equal_rewards(groups: list[Group], min_samples: int = 2) -> list[Group]:
    """Keep groups whose trainable samples do not all have the same reward (they carry signal)."""
    return [g for g in groups if len(g.rewards) >= min_samples and max(g.rewards) > min(g.rewards)]


class DynamicSampling:
    """DAPO's dynamic sampling: drop groups whose rewards are all equal, and generate more groups
    (at most ``max_extra_rounds`` more rounds a step) until the batch is full."""

    def __init__(self, max_extra_rounds: int = 4, min_samples: int = 2) -> None:
        if max_extra_rounds < 0:
            raise ValueError(f"max_extra_rounds must be >= 0, got {max_extra_rounds}")
        self.extra_rounds, self.min_samples = max_extra_rounds, min_samples

    def __call__(self, groups: list[Group]) -> list[Group]:
        return drop_equal_rewards(groups, self.min_samples)


class OverlongPenalty:
    """DAPO's soft overlong punishment: a response longer than ``max_len - buffer_len`` tokens loses
    ``penalty * (length - (max_len - buffer_len)) / buffer_len`` of its reward (at most ``penalty``)."""

    def __init__(self, max_len: int, buffer_len: int = 4, penalty: float = 1.0) -> None:
        if not 0 < buffer_len <= max_len:
            raise ValueError(f"need 0 < buffer_len <= max_len, got buffer_len={buffer_len}, max_len={max_len}")
        self.max_len, self.buffer_len, self.penalty = max_len, buffer_len, penalty
        self._penalised = self._seen = 0

    def __call__(self, groups: list[Group]) -> list[Group]:
        start = self.max_len - self.buffer_len
        for sample in (s for g in groups for s in g.trainable_samples):
            self._seen += 1
            excess = len(sample.response_ids) - start
            if excess > 0:
                cut = self.penalty * min(1.0, excess / self.buffer_len)
                sample.metadata["overlong_penalty"] = cut
                sample.reward = sample.scalar_reward - cut
                self._penalised += 1
        return groups

    def metrics(self) -> dict[str, float]:
        frac = self._penalised / self._seen if self._seen else 0.0
        self._penalised = self._seen = 0
        return {"selection/overlong_penalised_frac": frac}


class Buffer:
    """Keep the groups a step collected beyond its batch, and serve them first to later steps:
    ``policy=fifo`` the oldest first, ``recent`` the newest first; at most ``max_groups`` are kept
    (the oldest are dropped)."""

    def __init__(self, policy: str = "fifo", max_groups: int = 64) -> None:
        if policy not in ("fifo", "recent"):
            raise ValueError(f"policy must be 'fifo' or 'recent', got {policy!r}")
        if max_groups < 1:
            raise ValueError(f"max_groups must be >= 1, got {max_groups}")
        self.buffer_policy, self.max_groups = policy, max_groups

    def __call__(self, groups: list[Group]) -> list[Group]:
        return groups


class Curriculum:
    """Samples prompts by their recent pass rate: each prompt's weight is
    ``exp(-(p - target)^2 / (2 width^2))``, at least ``min_weight``, where ``p`` is the share of its
    last ``window`` samples that reached ``pass_reward`` (a prompt not yet seen counts as ``target``).
    With the default target 0.5, prompts the policy always or never solves are drawn less often."""

    def __init__(self, target: float = 0.5, width: float = 0.25, min_weight: float = 0.05, window: int = 16,
                 pass_reward: float = 1.0, seed: int = 0) -> None:
        if not 0 <= target <= 1 or width <= 0 or not 0 < min_weight <= 1 or window < 1:
            raise ValueError("need 0 <= target <= 1, width > 0, 0 < min_weight <= 1 and window >= 1")
        self.target, self.width, self.min_weight, self.window = target, width, min_weight, window
        self.pass_reward = pass_reward
        self.rng = random.Random(seed)
        self.history: dict[int, list[float]] = {}

    def pass_rate(self, row: int) -> float:
        seen = self.history.get(row)
        return sum(seen) / len(seen) if seen else self.target

    def weight(self, row: int) -> float:
        return max(self.min_weight, math.exp(-((self.pass_rate(row) - self.target) ** 2) / (2 * self.width**2)))

    def choose_prompts(self, data: Any, count: int) -> list[Any]:
        return self.rng.choices(data.prompts, weights=[self.weight(p.index) for p in data.prompts], k=count)

    def __call__(self, groups: list[Group]) -> list[Group]:
        for group in groups:
            for sample in group.trainable_samples:
                seen = self.history.setdefault(sample.metadata["row"], [])
                seen.append(float(sample.scalar_reward >= self.pass_reward))
                del seen[: -self.window]
        return groups

    def metrics(self) -> dict[str, float]:
        rates = [self.pass_rate(row) for row in self.history]
        return {"selection/curriculum_prompts_seen": len(rates),
                "selection/curriculum_mean_pass_rate": sum(rates) / len(rates) if rates else 0.0}

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.getstate(), "history": {k: list(v) for k, v in self.history.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.setstate(state["rng"])
        self.history = {int(k): list(v) for k, v in state["history"].items()}


@hookimpl(trylast=True)
def miles_register_data_selectors(register):
    register("drop_equal_rewards", drop_equal_rewards)
    register("dynamic_sampling", DynamicSampling)
    register("over_sampling", OverSampling)
    register("overlong_penalty", OverlongPenalty)
    register("buffer", Buffer)
    register("curriculum", Curriculum)
