"""The ``over_sampling`` selector; :class:`miles.rollout.collect.GroupCollector` reads its ``prompts_factor``."""

from __future__ import annotations

from miles.types import Group

__all__ = ["OverSampling"]


class OverSampling:
    """The ``over_sampling`` selector: generate ``factor`` times the prompts a round needs (filters downstream then
    have spares). Apart from the other builtin selectors: the simulation (:mod:`miles.simulate`) uses it too, and
    the module stays light, as ``miles config`` imports it."""

    def __init__(self, factor: float = 1.5) -> None:
        if factor < 1:
            raise ValueError(f"factor must be >= 1, got {factor}")
        self.prompts_factor = factor

    def __call__(self, groups: list[Group]) -> list[Group]:
        return groups
