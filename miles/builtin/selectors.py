"""Builtin data selectors, applied in the order listed under ``selection`` (see docs/algorithms/selection.md).

A selector is ``fn(groups) -> groups to keep``. A class-based selector may also shape how a step
collects its groups, through attributes the loop reads (:mod:`miles.rollout.collect`):
``extra_rounds`` (generate again while the batch is short), ``prompts_factor`` (generate more
prompts than the batch needs), ``buffer_policy`` (keep surplus groups for later steps), and
``metrics()`` (figures for the step's metrics line).
"""

from __future__ import annotations

from miles import hookimpl
from miles.types import Group

__all__ = ["drop_equal_rewards", "DynamicSampling", "OverSampling", "OverlongPenalty", "Buffer"]


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


class OverSampling:
    """Generate ``factor`` times the prompts a round needs (filters downstream then have spares)."""

    def __init__(self, factor: float = 1.5) -> None:
        if factor < 1:
            raise ValueError(f"factor must be >= 1, got {factor}")
        self.prompts_factor = factor

    def __call__(self, groups: list[Group]) -> list[Group]:
        return groups


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


@hookimpl(trylast=True)
def miles_register_data_selectors(register):
    register("drop_equal_rewards", drop_equal_rewards)
    register("dynamic_sampling", DynamicSampling)
    register("over_sampling", OverSampling)
    register("overlong_penalty", OverlongPenalty)
    register("buffer", Buffer)
