"""Builtin data selectors (filters applied to rewarded groups, in the order listed)."""

from __future__ import annotations

from miles import hookimpl
from miles.types import Group


def drop_equal_rewards(groups: list[Group], min_samples: int = 2) -> list[Group]:
    """Keep groups whose trainable samples do not all have the same reward (they carry signal)."""
    return [g for g in groups if len(g.rewards) >= min_samples and max(g.rewards) > min(g.rewards)]


@hookimpl(trylast=True)
def miles_register_data_selectors(register):
    register("drop_equal_rewards", drop_equal_rewards)
