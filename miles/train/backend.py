"""The contract between the loop and a training backend."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

from miles.types import LossInputs, TrainBatch

__all__ = ["TrainBackend", "LossFn"]

LossFn = Callable[[LossInputs], tuple[torch.Tensor, dict[str, float]]]


@runtime_checkable
class TrainBackend(Protocol):
    """A training backend owns the policy's trainable weights and its optimizer.

    The factory registered through ``miles_register_backends`` is called with the ``backend``
    config node's arguments; the loop then calls these methods.
    """

    def setup(self, model_path: str, *, seed: int, ref_model_path: str | None = None) -> None:
        """Load the policy from an HF-format directory and build the optimizer; with
        ``ref_model_path``, also a frozen reference model whose log-probs reach the loss as
        ``LossInputs.ref_logprobs`` (and ``ref_logprobs(batch)``)."""

    def ref_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """``[B, L-1]`` log-probs under the reference model (only when one was set up)."""

    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step on ``batch`` (split into micro-batches as configured).

        Returns metrics including ``train/loss`` and ``train/grad_norm``.
        """

    def export_weights(self) -> dict[str, torch.Tensor]:
        """The current weights by parameter name, for weight sync (not to be modified)."""

    def save_pretrained(self, path: str, tokenizer: Any = None, metadata: dict | None = None) -> None:
        """Write the policy in HF format (safetensors), atomically, with ``metadata`` as ``miles.json``."""

    def shutdown(self) -> None:
        """Release workers and memory."""
