"""Collecting one step's groups: rounds of generation and reward, the selectors in order, and a
buffer for surplus groups. Selectors shape this through optional attributes (see
:mod:`miles.builtin.selectors`); with plain filters it is one round of ``prompts_per_step`` prompts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from miles.rollout.context import RolloutContext
from miles.rollout.data_source import PromptSource
from miles.rollout.generate import make_groups, run_rollouts
from miles.rollout.reward import score_samples
from miles.types import Group, Sample

__all__ = ["GroupCollector", "Collected"]


@dataclass
class Collected:
    groups: list[Group]  # at most prompts_per_step, for training
    samples: list[Sample]  # every sample generated this step (each counted once)
    metrics: dict[str, float] = field(default_factory=dict)


class GroupCollector:
    def __init__(self, selectors: list[tuple[str, Callable]], prompts_per_step: int, n_samples: int) -> None:
        self.selectors, self.prompts_per_step, self.n_samples = selectors, prompts_per_step, n_samples
        self.extra_rounds = max((getattr(s, "extra_rounds", 0) for _, s in selectors), default=0)
        self.prompts_factor = max((getattr(s, "prompts_factor", 1.0) for _, s in selectors), default=1.0)
        choosers = [s for _, s in selectors if hasattr(s, "choose_prompts")]
        self.chooser = choosers[-1] if choosers else None
        buffers = [s for _, s in selectors if hasattr(s, "buffer_policy")]
        self.buffer_spec = buffers[-1] if buffers else None
        self.buffer: list[Group] = []  # oldest first
        self.next_group_index = 0

    def collect(self, data: PromptSource, rollout_fn: Callable, ctx: RolloutContext, reward_fn: Callable,
                check: Callable[[list[Sample]], Any]) -> Collected:
        """Groups for one step; ``check`` sees each round's samples (it raises past the failure ceiling)."""
        target = self.prompts_per_step
        kept = self._take(target)
        from_buffer = len(kept)
        samples: list[Sample] = []
        removed = [0] * len(self.selectors)
        rounds = 0
        while len(kept) < target and rounds <= self.extra_rounds:
            count = math.ceil((target - len(kept)) * self.prompts_factor)
            prompts = self.chooser.choose_prompts(data, count) if self.chooser else data.next(count)
            groups = make_groups(prompts, self.n_samples, first_group_index=self.next_group_index)
            self.next_group_index += count
            fresh = [s for g in groups for s in g.samples]
            run_rollouts(groups, rollout_fn, ctx)
            score_samples(fresh, reward_fn)
            check(fresh)
            samples += fresh
            for i, (_, selector) in enumerate(self.selectors):
                before = len(groups)
                groups = selector(groups)
                removed[i] += before - len(groups)
            kept += groups
            rounds += 1
        surplus, kept = kept[target:], kept[:target]
        dropped = self._store(surplus)
        metrics: dict[str, float] = {
            "selection/groups_removed": sum(removed),
            "selection/groups_kept": len(kept),
            "selection/rounds": rounds,
        }
        for (name, selector), count in zip(self.selectors, removed):
            metrics[f"selection/{name}_removed"] = count
            if hasattr(selector, "metrics"):
                metrics.update(selector.metrics())
        if self.buffer_spec is not None or surplus:
            metrics.update({"selection/groups_from_buffer": from_buffer, "selection/buffered": len(self.buffer),
                            "selection/surplus_dropped": dropped})
        return Collected(kept, samples, metrics)

    def _take(self, count: int) -> list[Group]:
        if self.buffer_spec is None or not self.buffer:
            return []
        if self.buffer_spec.buffer_policy == "recent":
            taken = self.buffer[-count:][::-1]
            del self.buffer[-count:]
        else:
            taken = self.buffer[:count]
            del self.buffer[:count]
        return taken

    def _store(self, surplus: list[Group]) -> int:
        """Buffer the surplus (without a buffer it is dropped); returns how many groups were dropped."""
        if self.buffer_spec is None:
            return len(surplus)
        self.buffer += surplus
        overflow = max(0, len(self.buffer) - self.buffer_spec.max_groups)
        del self.buffer[:overflow]
        return overflow

    def state_dict(self) -> dict[str, Any]:
        selectors = {i: s.state_dict() for i, (_, s) in enumerate(self.selectors) if hasattr(s, "state_dict")}
        return {"next_group_index": self.next_group_index, "buffer": list(self.buffer), "selectors": selectors}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_group_index, self.buffer = state["next_group_index"], list(state["buffer"])
        for i, selector_state in state["selectors"].items():
            self.selectors[i][1].load_state_dict(selector_state)
