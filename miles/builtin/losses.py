"""Builtin losses. Each returns a loss already divided by ``inputs.token_normalizer``."""

from __future__ import annotations

import torch

from miles import hookimpl
from miles.types import LossInputs


def _token_sum(values: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
    return (values * inputs.loss_mask).sum() / inputs.token_normalizer


def ppo_clip(inputs: LossInputs, clip_low: float = 0.2, clip_high: float = 0.2) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped surrogate, token-mean over the batch.

    ``ratio = exp(logp - logp_old)``; per token ``max(-A * ratio, -A * clip(ratio, 1 - clip_low,
    1 + clip_high))``.
    """
    log_ratio = inputs.logprobs - inputs.old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -inputs.advantages * ratio
    clipped = -inputs.advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = _token_sum(torch.maximum(unclipped, clipped), inputs)
    with torch.no_grad():
        metrics = {
            "train/clip_frac": float(_token_sum((clipped > unclipped).float(), inputs)),
            "train/approx_kl": float(_token_sum(0.5 * log_ratio**2, inputs)),
        }
    return loss, metrics


def sft(inputs: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """Negative log-likelihood of the loss-masked tokens, token-mean over the batch."""
    return _token_sum(-inputs.logprobs, inputs), {}


@hookimpl(trylast=True)
def miles_register_losses(register):
    register("ppo_clip", ppo_clip)
    register("sft", sft)
