"""The training losses: PPO's clipped surrogate (token or sequence ratio, clip-higher, dual clip, truncated
importance sampling, four aggregations), the SFT loss (both registered by :mod:`miles.builtin.losses`)
and the value model's loss, which the trainer applies itself. See docs/algorithms.md for the formulas.

Each carries ``check_args``: validation calls it with the config's arguments (over the defaults), so
values that do not work, alone or together, are refused before the run starts."""

from __future__ import annotations

from typing import Any

from miles.errors import RunError
from miles.lazy import lazy_module
from miles.types import LossInputs

torch = lazy_module("torch")

__all__ = ["AGGREGATIONS", "NonFiniteLoss", "aggregate", "non_finite_inputs", "ppo_clip", "sft", "value_loss"]

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant")


class NonFiniteLoss(RunError):
    """A loss (or its gradients) that is NaN or infinite, found before the optimizer step: the weights are those of
    the step before. The learner names the step (:class:`miles.loop.learner.Learner`)."""


def non_finite_inputs(inputs: LossInputs) -> str:
    """Which of a loss's inputs hold NaN or infinite values at the loss tokens, in words (what made the loss
    non-finite), else that the loss function made it so itself."""
    mask = inputs.loss_mask > 0
    named = (("the advantages", inputs.advantages), ("the policy's log-probs", inputs.logprobs),
             ("the log-probs it was sampled with", inputs.old_logprobs),
             ("the reference model's log-probs", inputs.ref_logprobs))
    bad = [name for name, values in named
           if values is not None and not bool(torch.isfinite(values.detach()[mask.to(values.device)]).all())]
    return (f"{', '.join(bad)} hold NaN or inf at loss tokens" if bad else
            "its inputs are finite at the loss tokens: the loss function made it so")


def aggregate(values: torch.Tensor, inputs: LossInputs, agg: str = "token_mean",
              norm_tokens: int | None = None) -> torch.Tensor:
    """Reduce per-token ``values`` over the loss mask; normalisers span the whole batch.

    ``token_mean``: sum / tokens; ``seq_mean_token_mean``: mean over sequences of each one's token
    mean; ``seq_mean_token_sum``: mean over sequences of each one's token sum; ``constant``: token
    sum / (sequences x ``norm_tokens``) (Dr. GRPO).
    """
    mask = inputs.loss_mask
    if agg == "token_mean":
        return (values * mask).sum() / inputs.token_normalizer
    per_sequence = (values * mask).sum(dim=1)
    if agg == "seq_mean_token_mean":
        return (per_sequence / mask.sum(dim=1).clamp(min=1)).sum() / inputs.sequence_normalizer
    if agg == "seq_mean_token_sum":
        return per_sequence.sum() / inputs.sequence_normalizer
    if agg == "constant":
        return per_sequence.sum() / (inputs.sequence_normalizer * norm_tokens)
    raise ValueError(f"unknown aggregation {agg!r}; expected one of {', '.join(AGGREGATIONS)}")


def _check_aggregation(args: dict[str, Any]) -> None:
    agg, norm_tokens = args["agg"], args["norm_tokens"]
    if agg not in AGGREGATIONS:
        raise ValueError(f"agg={agg!r} is not an aggregation; expected one of {', '.join(AGGREGATIONS)}")
    if agg == "constant" and (isinstance(norm_tokens, bool) or not isinstance(norm_tokens, int) or norm_tokens < 1):
        got = "" if norm_tokens is None else f", got {norm_tokens!r}"
        raise ValueError(f"agg=constant needs norm_tokens, a whole number >= 1 (each sequence's summed loss is "
                         f"divided by it){got}")


def _token_mean(values: torch.Tensor, inputs: LossInputs) -> float:
    return float((values * inputs.loss_mask).sum() / inputs.token_normalizer)


def _sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, 1]``: each sequence's mean of ``values`` over its masked tokens."""
    return ((values * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)).unsqueeze(1)


def _importance_weights(inputs: LossInputs, level: str, mode: str, cap: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance sampling between the trainer's old log-probs and the engine's."""
    mask = inputs.loss_mask
    log_w = inputs.old_logprobs - inputs.batch.rollout_logprobs.to(inputs.old_logprobs.device)
    if level == "sequence":
        log_w = (log_w * mask).sum(dim=1, keepdim=True).expand_as(mask)
    weights = log_w.clamp(max=30.0).exp()
    over = (weights > cap) | (weights < 1.0 / cap) if mode == "mask_both" else weights > cap
    corrected = weights.clamp(max=cap) if mode == "truncate" else torch.where(over, 0.0, weights)
    return corrected.detach(), {"train/is_weight_mean": _token_mean(weights, inputs),
                                "train/is_clipped_frac": _token_mean(over.float(), inputs)}


def ppo_clip(inputs: LossInputs, clip_low: float = 0.2, clip_high: float = 0.2, clip_c: float | None = None,
             ratio: str = "token", agg: str = "token_mean", norm_tokens: int | None = None,
             tis: str = "none", tis_mode: str = "truncate",
             tis_cap: float = 2.0) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped surrogate: per token ``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``.

    ``ratio="token"``: ``r = exp(logp - logp_old)`` per token; ``"sequence"`` (GSPO): each
    sequence's length-normalised ratio ``exp(mean_t(logp - logp_old))``, with each token's gradient.
    ``clip_c`` (dual clip, > 1) bounds the loss of negative-advantage tokens at ``-A clip_c``.
    ``tis`` (``token`` or ``sequence``) weights each token by ``exp(logp_old - logp_rollout)``,
    truncated at ``tis_cap`` (``tis_mode=truncate``), dropped above it (``mask``) or dropped outside
    ``[1 / tis_cap, tis_cap]`` (``mask_both``, masked importance sampling); it needs the
    backend's ``old_logprobs: recompute``. ``agg``: see :func:`aggregate`.
    """
    mask, advantages = inputs.loss_mask, inputs.advantages
    log_ratio = inputs.logprobs - inputs.old_logprobs
    if ratio == "sequence":
        sequence = _sequence_mean(log_ratio, mask)
        log_ratio = sequence.detach() + inputs.logprobs - inputs.logprobs.detach()
    ratios = torch.exp(log_ratio)
    unclipped = -advantages * ratios
    clipped = -advantages * ratios.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    metrics: dict[str, float] = {}
    with torch.no_grad():
        metrics["train/clip_frac"] = _token_mean((clipped > unclipped).float(), inputs)
        metrics["train/approx_kl"] = _token_mean(0.5 * (inputs.logprobs - inputs.old_logprobs) ** 2, inputs)
    if clip_c is not None:
        bound = -advantages * clip_c
        dual = (advantages < 0) & (per_token > bound)
        per_token = torch.where(advantages < 0, torch.minimum(per_token, bound), per_token)
        metrics["train/dual_clip_frac"] = _token_mean(dual.float(), inputs)
    if tis != "none":
        weights, tis_metrics = _importance_weights(inputs, tis, tis_mode, tis_cap)
        per_token = per_token * weights
        metrics.update(tis_metrics)
    return aggregate(per_token, inputs, agg, norm_tokens), metrics


def _check_ppo_clip(args: dict[str, Any]) -> None:
    _check_aggregation(args)
    for key, choices in (("ratio", ("token", "sequence")), ("tis", ("none", "token", "sequence")),
                         ("tis_mode", ("truncate", "mask", "mask_both"))):
        if args[key] not in choices:
            raise ValueError(f"{key}={args[key]!r}: expected {', '.join(choices[:-1])} or {choices[-1]}")
    if not (0 <= args["clip_low"] < 1 and args["clip_high"] >= 0):
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got clip_low={args['clip_low']!r}, "
                         f"clip_high={args['clip_high']!r}")
    clip_c = args["clip_c"]
    if clip_c is not None and (isinstance(clip_c, bool) or not isinstance(clip_c, (int, float)) or clip_c <= 1):
        raise ValueError(f"clip_c (the dual clip) must be a number > 1, or null for none, got {clip_c!r}")
    if not args["tis_cap"] > 0:
        raise ValueError(f"tis_cap must be > 0, got {args['tis_cap']!r}")


ppo_clip.check_args = _check_ppo_clip  # type: ignore[attr-defined]


def sft(inputs: LossInputs, agg: str = "token_mean",
        norm_tokens: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Negative log-likelihood of the loss-masked tokens, reduced by ``agg`` (see :func:`aggregate`)."""
    return aggregate(-inputs.logprobs, inputs, agg, norm_tokens), {}


sft.check_args = _check_aggregation  # type: ignore[attr-defined]


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               normalizer: float, clip: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The value model's loss (PPO): ``0.5 max((V - R)^2, (clip(V, V_old +- clip) - R)^2)``, summed over
    the loss-masked tokens and divided by ``normalizer`` (the mini-batch's token count over all ranks,
    as the policy loss). Metrics are this micro-batch's share: ``critic/clip_frac`` (with a clip) and
    ``critic/value_mean``."""
    loss_t = (values - returns) ** 2
    metrics: dict[str, float] = {}
    if clip is not None:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        loss_t = torch.maximum(loss_t, (clipped - returns) ** 2)
        metrics["critic/clip_frac"] = float((((values - old_values).abs() > clip).float() * mask).sum()) / normalizer
    metrics["critic/value_mean"] = float((values.detach() * mask).sum()) / normalizer
    return 0.5 * (loss_t * mask).sum() / normalizer, metrics
