"""KL to a frozen reference policy (k1, k2, k3 estimators) and the entropy bonus.

With ``r = p_ref(x) / p(x)`` for a sampled token ``x`` and ``d = log p(x) - log p_ref(x)``:
``k1 = d`` (unbiased, can be negative), ``k2 = d**2 / 2``, ``k3 = r - 1 - log r = exp(-d) - 1 + d``
(unbiased and never negative).
"""

from __future__ import annotations

from collections.abc import Callable

from miles.lazy import lazy_module
from miles.types import LossInputs

torch = lazy_module("torch")

__all__ = ["KL_ESTIMATORS", "kl_estimate", "regularized"]


def _k1(d: torch.Tensor) -> torch.Tensor:
    return d


def _k2(d: torch.Tensor) -> torch.Tensor:
    return 0.5 * d**2


def _k3(d: torch.Tensor) -> torch.Tensor:
    return torch.exp(-d) - 1 + d


KL_ESTIMATORS = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(p || p_ref) from the sampled tokens' log-probs."""
    return KL_ESTIMATORS[estimator](logprobs - ref_logprobs)


def regularized(loss_fn: Callable, *, kl_coef: float = 0.0, kl_estimator: str = "k3",
                entropy_coef: float = 0.0) -> Callable:
    """``loss_fn`` plus ``kl_coef * KL`` (token mean) minus ``entropy_coef * entropy`` (token mean)."""
    if kl_coef == 0 and entropy_coef == 0:
        return loss_fn

    def loss_with_terms(inputs: LossInputs):
        loss, metrics = loss_fn(inputs)
        metrics = dict(metrics)
        if kl_coef:
            kl = (kl_estimate(inputs.logprobs, inputs.ref_logprobs, kl_estimator) * inputs.loss_mask).sum()
            loss = loss + kl_coef * kl / inputs.token_normalizer
        if entropy_coef:
            entropy = (inputs.entropy * inputs.loss_mask).sum()
            loss = loss - entropy_coef * entropy / inputs.token_normalizer
        return loss, metrics

    loss_with_terms.needs_entropy_grad = entropy_coef != 0  # type: ignore[attr-defined]
    return loss_with_terms
