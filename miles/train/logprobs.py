"""Per-token log-probs of a causal LM over right-padded sequences."""

from __future__ import annotations

import torch

__all__ = ["token_logprobs"]


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """``[B, L-1]``: column ``t`` is log p(input_ids[:, t+1] | input_ids[:, :t+1]).

    Sequences are right-padded, so causal attention alone keeps padding out of every real token's
    context; padded columns hold garbage that the loss mask removes.
    """
    logits = model(input_ids=input_ids).logits[:, :-1].float()
    targets = input_ids[:, 1:].unsqueeze(-1)
    return logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)
