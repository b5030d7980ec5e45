"""Low-precision rollout on the wire (``rollout.precision``): the trainer quantizes its weights once per push and every
transport sends the stored form (values and scales) that the engines hold.

:class:`StoredFormPush` wraps the configured transport: each push hands it a view of the backend whose
``export_weights()`` is the stored form (:func:`miles.precision.linear.quantize_weights`) and whose
``save_pretrained`` writes a checkpoint in it (:func:`miles.precision.checkpoint.write_stored_form`), so that
``tensor``, ``shm``, ``disk``, ``distributed``, ``in_process`` and their delta variants send it unchanged. It reports
each push's bytes beside the bytes of the same weights in bfloat16.
"""

from __future__ import annotations

from typing import Any

from miles.lazy import lazy_module
from miles.precision.linear import quantize_weights
from miles.precision.schemes import Scheme
from miles.weights.fleet import Endpoint, Engines

torch = lazy_module("torch")

__all__ = ["StoredFormPush"]


class _StoredFormView:
    """The backend as a transport sees it: its weights in the stored form."""

    def __init__(self, backend: Any, push: StoredFormPush) -> None:
        self._backend, self._push = backend, push

    def export_weights(self) -> dict[str, torch.Tensor]:
        weights = self._backend.export_weights()
        self._push.bf16_bytes = sum(t.numel() * (2 if t.is_floating_point() else t.element_size())
                                    for t in weights.values())
        stored = quantize_weights(weights, self._push.scheme, self._push.layers)
        self._push.stored_bytes = sum(t.numel() * t.element_size() for t in stored.values())
        return stored

    def save_pretrained(self, path: str) -> None:
        from miles.precision.checkpoint import write_stored_form

        self._backend.save_pretrained(path)
        write_stored_form(path, self._push.scheme, self._push.layers)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


class StoredFormPush:
    """The configured transport (``transport``), sending the stored form of ``layers`` in ``scheme``."""

    def __init__(self, transport: Any, scheme: Scheme, layers: list[str]) -> None:
        self.transport, self.scheme, self.layers = transport, scheme, list(layers)
        self.stored_bytes = self.bf16_bytes = 0

    def push(self, backend: Any, plane: Engines, version: int) -> int:
        return self.transport.push(_StoredFormView(backend, self), plane, version)

    async def catch_up(self, plane: Engines, engine: Endpoint) -> None:
        await self.transport.catch_up(plane, engine)

    def metrics(self) -> dict[str, float]:
        """The inner transport's figures, and the last push's bytes in the stored form and in bfloat16."""
        inner = self.transport.metrics() if hasattr(self.transport, "metrics") else {}
        ours = {"weight_sync/stored_bytes": float(self.stored_bytes),
                "weight_sync/bf16_bytes": float(self.bf16_bytes)} if self.bf16_bytes else {}
        return {**inner, **ours}

    def __getattr__(self, name: str) -> Any:
        # close, use_disk, exports_only ...: the inner transport's (optional capabilities are found by hasattr)
        return getattr(self.transport, name)
