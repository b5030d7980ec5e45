"""Collecting one step's groups: rounds of generation and reward, the selectors in order, and a
buffer for surplus groups. Selectors shape this through optional attributes (see
:mod:`miles.builtin.selectors`); with plain filters it is one round of ``prompts_per_step`` prompts.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from miles import interrupts
from miles.rollout.context import RolloutContext
from miles.rollout.data_source import PromptSource
from miles.rollout.generate import make_groups, run_one, run_rollouts
from miles.rewards.scoring import score_samples, score_samples_async
from miles.types import Group, Sample, SampleStatus

__all__ = ["GroupCollector", "Collected"]


@dataclass
class Collected:
    groups: list[Group]  # at most prompts_per_step, for training
    samples: list[Sample]  # every sample generated this step (each counted once)
    metrics: dict[str, float] = field(default_factory=dict)


def _timed_out(samples: list[Sample], stage: str) -> int:
    return sum(s.status is SampleStatus.FAILED and (s.reason or "").startswith(f"{stage}: timed out")
               for s in samples)


class GroupCollector:
    """With ``partial_rollout``, each round's groups are selected as they complete, and once the batch
    is full the engines abort what is still generating: those samples keep their tokens and are
    continued first in the next step, under the weights of that step."""

    def __init__(self, selectors: list[tuple[str, Callable]], prompts_per_step: int, n_samples: int,
                 partial_rollout: bool = False) -> None:
        self.selectors, self.prompts_per_step, self.n_samples = selectors, prompts_per_step, n_samples
        self.partial_rollout = partial_rollout
        self.unfinished: list[Group] = []  # partial rollouts waiting to be continued
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
            resumed, self.unfinished = self.unfinished, []
            count = max(0, math.ceil((target - len(kept)) * self.prompts_factor) - len(resumed))
            prompts = data.draw(count, self.chooser)
            groups = resumed + make_groups(prompts, self.n_samples, first_group_index=self.next_group_index)
            self.next_group_index += count
            if self.partial_rollout:
                ctx.abort_requested = False
                run = ctx.run or interrupts.run
                done, removed_now, completed = run(self._round_partial(groups, rollout_fn, ctx, reward_fn,
                                                                       target - len(kept)))
                fresh = [s for g in completed for s in g.samples]
                check(fresh)
            else:
                fresh = [s for g in groups for s in g.samples]
                run_rollouts(groups, rollout_fn, ctx)
                score_samples(fresh, reward_fn)
                check(fresh)
                done, removed_now = self.select(groups)
            samples += fresh
            removed = [a + b for a, b in zip(removed, removed_now)]
            kept += done
            rounds += 1
        surplus, kept = kept[target:], kept[:target]
        dropped = self._store(surplus)
        metrics = {**self.selection_metrics(samples, kept, removed), "selection/rounds": rounds}
        if self.partial_rollout:
            metrics["rollout/partial_groups"] = len(self.unfinished)
            metrics["rollout/off_policy_token_frac"] = (
                sum(s.off_policy_tokens for s in samples) / max(1, sum(len(s.response_ids) for s in samples)))
        if self.buffer_spec is not None or surplus:
            metrics.update({"selection/groups_from_buffer": from_buffer, "selection/buffered": len(self.buffer),
                            "selection/surplus_dropped": dropped})
        return Collected(kept, samples, metrics)

    def select(self, groups: list[Group]) -> tuple[list[Group], list[int]]:
        """The selectors in order over ``groups``: those kept, and how many each selector removed."""
        removed = []
        for _, selector in self.selectors:
            before = len(groups)
            groups = selector(groups)
            removed.append(before - len(groups))
        return groups, removed

    async def _round_partial(self, groups: list[Group], rollout_fn: Callable, ctx: RolloutContext,
                             reward_fn: Callable, room: int) -> tuple[list[Group], list[int], list[Group]]:
        """Select groups as they complete; once ``room`` are kept, abort the rest and keep them.
        Returns the kept groups, the removals per selector and every completed group."""
        async def run_group(group: Group) -> Group:
            todo = [s for s in group.samples if s.status in (SampleStatus.PENDING, SampleStatus.ABORTED)]
            for sample in todo:
                sample.status = SampleStatus.PENDING
            await asyncio.gather(*(run_one(rollout_fn, s, ctx) for s in todo))
            return group

        kept: list[Group] = []
        removed = [0] * len(self.selectors)
        completed: list[Group] = []
        aborted = False
        for next_group in asyncio.as_completed([asyncio.ensure_future(run_group(g)) for g in groups]):
            group = await next_group
            if any(s.status is SampleStatus.ABORTED for s in group.samples):
                self.unfinished.append(group)
                continue
            await score_samples_async(group.samples, reward_fn)
            completed.append(group)
            selected, removed_now = self.select([group])
            removed = [a + b for a, b in zip(removed, removed_now)]
            kept += selected
            if len(kept) >= room and not aborted:
                aborted = True
                ctx.abort_requested = True  # multi-turn trajectories between turns stop there too
                result = ctx.engine.abort()
                if inspect.isawaitable(result):
                    await result
        return kept, removed, completed

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

    def selection_metrics(self, samples: list[Sample], kept: list[Group], removed: list[int]) -> dict[str, float]:
        """What selection did to a step's batch (``removed``: groups per selector), with the selectors' own
        figures, and the samples that timed out in each stage."""
        metrics: dict[str, float] = {
            "selection/groups_removed": sum(removed),
            "selection/groups_kept": len(kept),
            **{f"{stage}/timeouts": _timed_out(samples, stage) for stage in ("rollout", "reward")},
        }
        for (name, selector), count in zip(self.selectors, removed):
            metrics[f"selection/{name}_removed"] = count
            if hasattr(selector, "metrics"):
                metrics.update(selector.metrics())
        return metrics

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
        return {"next_group_index": self.next_group_index, "buffer": list(self.buffer), "selectors": selectors,
                "unfinished": list(self.unfinished)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_group_index, self.buffer = state["next_group_index"], list(state["buffer"])
        self.unfinished = list(state.get("unfinished", []))
        for i, selector_state in state["selectors"].items():
            self.selectors[i][1].load_state_dict(selector_state)
