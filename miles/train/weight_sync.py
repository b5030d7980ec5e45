"""Weight transports: how a backend's new weights reach the rollout engines."""

from __future__ import annotations

from typing import Any

__all__ = ["InProcessTransport"]


class InProcessTransport:
    """Registered as weight transport ``in_process``: copies tensors into engines in this process."""

    def push(self, backend: Any, engines: list[Any]) -> int:
        weights = backend.export_weights()
        for engine in engines:
            engine.update_weights(weights)
        return sum(t.numel() * t.element_size() for t in weights.values())
