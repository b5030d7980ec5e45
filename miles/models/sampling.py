"""The distribution a sampled token's log-prob is taken under, defined once for the engine and the trainer.

An engine draws each token from ``softmax(truncate(logits / T))``: the temperature ``T``, then top-k (the ``k``
most likely tokens) and top-p (a token stays while the probability mass of the tokens more likely than it is at
most ``p``, SGLang's rule), renormalised. ``rollout.logprobs_of`` names the distribution whose log-probs the engine
reports and the trainer computes, so that importance ratios, TIS, the KL and the policy gradient are all of one
policy:

- ``sampling`` (the default, SGLang's and what verl and slime train with): ``softmax(logits / T)``, the
  temperature's distribution before truncation;
- ``truncated``: the distribution the token was drawn from, temperature and truncation (the trainer truncates
  its own logits by the same rule, and always keeps the sampled token, so that its log-prob is finite);
- ``model``: ``softmax(logits)``, the model's own distribution (``T = 1``).

A greedy token (``T = 0``) was not drawn from a distribution: its log-prob is the model's (``T = 1``, nothing
truncated) in every mode, as SGLang reports it.
"""

from __future__ import annotations

from miles.lazy import lazy_module

torch = lazy_module("torch")

__all__ = ["LOGPROBS_OF", "MIN_TEMPERATURE", "effective_temperature", "scaled_logits", "truncated_logits",
           "distribution_logits", "truncates", "left_out"]

LOGPROBS_OF = ("sampling", "truncated", "model")
MIN_TEMPERATURE = 1e-5  # a smaller temperature is taken as this one: logits / 1e-40 would overflow to inf


def effective_temperature(temperature: torch.Tensor) -> torch.Tensor:
    """The temperature a distribution is taken at: ``temperature`` (at least :data:`MIN_TEMPERATURE`), and 1 where
    it is 0 (greedy)."""
    return torch.where(temperature > 0, temperature.clamp(min=MIN_TEMPERATURE), torch.ones_like(temperature))


def truncates(top_p: torch.Tensor | None, top_k: torch.Tensor | None) -> bool:
    """Whether any row's top-p or top-k may leave a token out."""
    if top_p is None or top_k is None:
        return (top_p is not None and bool((top_p < 1).any())) or (top_k is not None and bool((top_k > 0).any()))
    return bool(((top_k > 0) | (top_p < 1)).any())


def left_out(scaled: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
             keep: torch.Tensor | None = None) -> torch.Tensor:
    """``[..., V]`` bool, True at the tokens that top-k and top-p leave out of each distribution of ``scaled``
    (temperature-scaled logits, ``[..., V]``); ``top_p`` and ``top_k`` are ``[...]`` (1.0 and -1: off).
    ``keep`` (``[...]`` token ids): a token that stays in whatever the rule says (the trainer's sampled token)."""
    with torch.no_grad():
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        vocab = scaled.shape[-1]
        ranks = torch.arange(vocab, device=scaled.device)
        k = torch.where(top_k > 0, top_k, vocab).unsqueeze(-1)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop = (ranks >= k) | (mass_before > top_p.unsqueeze(-1))
        if keep is not None:
            drop &= order != keep.unsqueeze(-1)
        return torch.empty_like(drop).scatter_(-1, order, drop)


def scaled_logits(logits: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
    """``logits`` (``[..., V]``) at each row's temperature (``[...]``; None: 1 everywhere)."""
    if temperature is None:
        return logits
    return logits / effective_temperature(temperature).unsqueeze(-1).to(logits.dtype)


def truncated_logits(scaled: torch.Tensor, temperature: torch.Tensor | None, top_p: torch.Tensor | None,
                     top_k: torch.Tensor | None, keep: torch.Tensor | None = None) -> torch.Tensor:
    """``scaled`` with the tokens that ``top_p`` and ``top_k`` (``[...]``; None: off) leave out at ``-inf``; a
    greedy row (``temperature`` 0) keeps every token. Differentiable in ``scaled``."""
    if not truncates(top_p, top_k):
        return scaled
    shape, device = scaled.shape[:-1], scaled.device
    top_p = torch.ones(shape, device=device) if top_p is None else top_p
    top_k = torch.full(shape, -1, dtype=torch.long, device=device) if top_k is None else top_k
    if temperature is not None and bool((temperature == 0).any()):  # a greedy token is the model's
        greedy = temperature == 0
        top_p, top_k = top_p.masked_fill(greedy, 1.0), top_k.masked_fill(greedy, -1)
    return scaled.masked_fill(left_out(scaled.detach(), top_p, top_k, keep), float("-inf"))


def distribution_logits(logits: torch.Tensor, temperature: torch.Tensor | None, top_p: torch.Tensor | None = None,
                        top_k: torch.Tensor | None = None, keep: torch.Tensor | None = None) -> torch.Tensor:
    """The logits (``[..., V]``) of the distribution a token's log-prob is taken under: ``logits`` at each row's
    temperature (``[...]``), with what ``top_p`` and ``top_k`` leave out at ``-inf``; ``keep``: token ids never
    left out. Differentiable in ``logits``."""
    return truncated_logits(scaled_logits(logits, temperature), temperature, top_p, top_k, keep)
