"""The plugin module named by the entry point: rewards and the hook that registers them."""

from __future__ import annotations

import miles
from miles import Sample


def numeric_closeness(sample: Sample, scale: float = 5.0) -> float:
    """1.0 for the right number, less the further off it is (0 past ``scale``); 0.0 if not a number."""
    try:
        answer, target = float(sample.response_text.strip()), float(str(sample.label).strip())
    except ValueError:
        return 0.0
    return max(0.0, 1.0 - abs(answer - target) / scale)


@miles.hookimpl
def miles_register_rewards(register):
    register("numeric_closeness", numeric_closeness)
