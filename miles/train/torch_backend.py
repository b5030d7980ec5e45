"""The builtin single-process torch backend: AdamW, gradient clipping, micro-batches."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from miles.models import load_model, save_pretrained
from miles.train.backend import LossFn
from miles.train.batching import micro_batch_indices
from miles.train.logprobs import token_logprobs
from miles.train.regularizers import kl_estimate
from miles.types import LossInputs, TrainBatch

__all__ = ["TorchBackend"]


class TorchBackend:
    """Registered as backend ``torch``."""

    def __init__(
        self,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        beta1: float = 0.9,
        beta2: float = 0.999,
        max_grad_norm: float = 1.0,
        micro_batch_size: int = 256,
        max_tokens_per_micro_batch: int | None = None,
        old_logprobs: str = "rollout",
    ) -> None:
        if lr <= 0:
            raise ValueError(f"lr must be positive, got {lr}")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        self.lr = lr
        self.weight_decay = weight_decay
        self.betas = (beta1, beta2)
        self.max_grad_norm = max_grad_norm
        self.micro_batch_size = micro_batch_size
        if max_tokens_per_micro_batch is not None and max_tokens_per_micro_batch < 1:
            raise ValueError(f"max_tokens_per_micro_batch must be >= 1, got {max_tokens_per_micro_batch}")
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch
        if old_logprobs not in ("rollout", "recompute"):
            raise ValueError(f"old_logprobs must be 'rollout' (the engine's) or 'recompute' (a trainer forward pass), "
                             f"got {old_logprobs!r}")
        self.old_logprobs = old_logprobs
        self.model: Any = None

    def setup(self, model_path: str, *, seed: int, ref_model_path: str | None = None) -> None:
        torch.manual_seed(seed)
        self.model = load_model(model_path).train()
        self.ref_model = None
        if ref_model_path is not None:
            self.ref_model = load_model(ref_model_path).eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=self.lr, betas=self.betas, weight_decay=self.weight_decay
        )

    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        normalizer = float(max(batch.num_tokens, 1))
        totals: dict[str, float] = defaultdict(float)
        micro_batches = 0
        lengths = batch.attention_mask.sum(dim=1)
        splits = micro_batch_indices(lengths, max_samples=self.micro_batch_size, max_tokens=self.max_tokens_per_micro_batch)
        micros = [batch.select(rows if len(rows) < len(batch) else slice(None)) for rows in splits]
        if self.old_logprobs == "recompute":
            with torch.no_grad():
                olds = [token_logprobs(self.model, micro.input_ids) for micro in micros]
        else:
            olds = [micro.rollout_logprobs for micro in micros]
        for micro, old in zip(micros, olds):
            logprobs, entropy = token_logprobs(self.model, micro.input_ids, with_entropy=True,
                                               entropy_grad=getattr(loss_fn, "needs_entropy_grad", False))
            ref = self.ref_logprobs(micro) if self.ref_model is not None else None
            inputs = LossInputs(logprobs, old, micro.advantages, micro.loss_mask, normalizer, micro, ref, entropy)
            loss, metrics = loss_fn(inputs)
            with torch.no_grad():
                mask = micro.loss_mask
                totals["train/entropy"] += float((entropy * mask).sum()) / normalizer
                if ref is not None:
                    totals["train/kl"] += float((kl_estimate(logprobs, ref, "k3") * mask).sum()) / normalizer
                # How far the trainer's log-probs are from the engine's for the same tokens (0 when they agree).
                gap = (logprobs.detach() - micro.rollout_logprobs).abs()
                totals["train/rollout_logprob_abs_diff"] += float((gap * mask).sum()) / normalizer
            loss.backward()
            micro_batches += 1
            totals["train/loss"] += float(loss.detach())
            for key, value in metrics.items():
                totals[key] += float(value)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        totals["train/grad_norm"] = float(grad_norm)
        totals["train/lr"] = self.lr
        totals["train/micro_batches"] = micro_batches
        return dict(totals)

    @torch.no_grad()
    def ref_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """``[B, L-1]`` log-probs of the batch's tokens under the frozen reference model."""
        if self.ref_model is None:
            raise ValueError("no reference model: set up the backend with ref_model_path")
        return token_logprobs(self.ref_model, batch.input_ids)

    def export_weights(self) -> dict[str, torch.Tensor]:
        return {name: tensor.detach() for name, tensor in self.model.state_dict().items()}

    def save_pretrained(self, path: str, tokenizer: Any = None, metadata: dict | None = None) -> None:
        save_pretrained(self.model, tokenizer, path, metadata)

    def shutdown(self) -> None:
        self.model = None
        self.optimizer = None
