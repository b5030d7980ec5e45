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
    context_length: int | None = None  # the model's, in tokens (prompt and response together)
    # Agentic rollouts (rollout.env, rollout.sandbox, rollout.tool_parser); None when not configured.
    env: Callable[..., Any] | None = None  # env factory: env(EnvContext) -> a fresh env
    sandbox: Callable[[], Any] | None = None  # sandbox factory: sandbox() -> a fresh sandbox
    tool_parser: Any = None
    chat_format: Any = None  # miles.agentic.chat_format.BoundFormat: how the model family talks (model.chat_format)
    tito_on_mismatch: str = "split"  # rollout.tito.on_mismatch (auto resolved): fail | split | retokenize
    tool: Callable[[str], Any] | None = None  # a registered tool by name
    seed: int = 0
    # Set by the collector once a partial-rollout batch is full: trajectories stop before their next turn.
    abort_requested: bool = False
    return_routed_experts: bool = False  # rollout.return_routed_experts: ask the engine for each token's expert ids
    images: Any = None  # a vision-language model's miles.models.vision.ImageEncoder (None: text only)

    @property
    def generate_options(self) -> dict[str, Any]:
        """Keyword arguments for ``engine.generate`` beyond the prompt and sampling parameters that the config
        asks for (``return_routed_experts``); pass the answer to ``Sample.record_routing`` to keep them."""
        return {"return_routed_experts": True} if self.return_routed_experts else {}
