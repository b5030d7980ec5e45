"""Per-token log-probs of a causal LM over right-padded sequences."""

from __future__ import annotations

import torch

__all__ = ["token_logprobs"]


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, with_entropy: bool = False,
                   entropy_grad: bool = False):
    """``[B, L-1]``: column ``t`` is log p(input_ids[:, t+1] | input_ids[:, :t+1]).

    Sequences are right-padded, so causal attention alone keeps padding out of every real token's
    context; padded columns hold garbage that the loss mask removes. With ``with_entropy``, also the
    entropy of each predicted distribution (``[B, L-1]``; differentiable only with ``entropy_grad``,
    which an entropy bonus needs).
    """
    logits = model(input_ids=input_ids).logits[:, :-1].float()
    targets = input_ids[:, 1:].unsqueeze(-1)
    log_norm = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(-1, targets).squeeze(-1) - log_norm
    if not with_entropy:
        return logprobs
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        log_p = logits - log_norm.unsqueeze(-1)
        return logprobs, -(log_p.exp() * log_p).sum(dim=-1)
