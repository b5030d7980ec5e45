"""What a rollout function is given besides its sample."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RolloutContext"]


@dataclass
class RolloutContext:
    engine: Any  # has `async generate(input_ids, sampling_params, return_logprob)`
    tokenizer: Any
    sampling_params: dict[str, Any] = field(default_factory=dict)
    run: Callable[[Coroutine], Any] | None = field(default=None, repr=False)  # runs a coroutine on the plane's loop
