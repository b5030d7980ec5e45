"""What a rollout function is given besides its sample."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["RolloutContext"]


@dataclass
class RolloutContext:
    engine: Any  # has `async generate(input_ids, sampling_params, return_logprob)`
    tokenizer: Any
    sampling_params: dict[str, Any] = field(default_factory=dict)
