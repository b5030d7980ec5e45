"""Builtin advantage estimators: ``fn(batch, **args) -> Tensor[B, L-1]`` (see docs/algorithms.md).

Sequence rewards are ``batch.sequence_rewards()``: the reward minus the summed token KL penalty when
``regularization.kl_in`` is ``reward``; REINFORCE++ uses the token penalties themselves.
An estimator may carry ``loss_defaults``: loss arguments the runner fills in when the config's loss
node does not set them (GSPO's sequence-level ratio, Dr. GRPO's constant normaliser), and
``check_args``: validation calls it with the config's arguments and it raises ValueError for values
that do not work together.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from miles import hookimpl
from miles.types import TrainBatch

if TYPE_CHECKING:  # torch is imported where used: registering the estimators imports nothing heavy
    import torch

__all__ = ["group_stats", "batch_whiten", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gspo",
           "ppo"]


def group_stats(values: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row group mean, unbiased std (0 for groups of one) and group size."""
    import torch

    _, inverse = group_index.unique(return_inverse=True)
    groups = int(inverse.max().item()) + 1
    count = torch.zeros(groups).index_add_(0, inverse, torch.ones_like(values))
    mean = torch.zeros(groups).index_add_(0, inverse, values) / count
    centered = values - mean[inverse]
    sq = torch.zeros(groups).index_add_(0, inverse, centered**2)
    std = torch.where(count > 1, (sq / (count - 1).clamp(min=1)).sqrt(), torch.zeros_like(count))
    return mean[inverse], std[inverse], count[inverse]


def batch_whiten(advantages: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Batch whitening over the masked tokens: zero mean, unit (population) std."""
    count = mask.sum().clamp(min=1)
    mean = (advantages * mask).sum() / count
    var = (((advantages - mean) * mask) ** 2).sum() / count
    return (advantages - mean) / (var.sqrt() + eps) * mask


def _per_token(per_sequence: torch.Tensor, batch: TrainBatch, whiten_batch: bool) -> torch.Tensor:
    advantages = per_sequence.unsqueeze(1) * batch.loss_mask
    return batch_whiten(advantages, batch.loss_mask) if whiten_batch else advantages


def grpo(batch: TrainBatch, normalize_std: bool = True, eps: float = 1e-6, whiten: bool = False) -> torch.Tensor:
    """GRPO: ``(r - mean_group(r)) / (std_group(r) + eps)`` per sequence, on every response token.

    ``std`` is the unbiased std of the group's rewards; ``normalize_std=False`` only subtracts the mean.
    """
    rewards = batch.sequence_rewards()
    mean, std, _ = group_stats(rewards, batch.group_index)
    advantage = rewards - mean
    if normalize_std:
        advantage = advantage / (std + eps)
    return _per_token(advantage, batch, whiten)


def dr_grpo(batch: TrainBatch, whiten: bool = False) -> torch.Tensor:
    """Dr. GRPO: ``r - mean_group(r)``, no std division; pairs with a constant loss normaliser."""
    rewards = batch.sequence_rewards()
    mean, _, _ = group_stats(rewards, batch.group_index)
    return _per_token(rewards - mean, batch, whiten)


dr_grpo.loss_defaults = {"agg": "constant"}  # type: ignore[attr-defined]


def _check_eps(args: dict[str, Any]) -> None:
    if args.get("normalize_std", True) and not args["eps"] > 0:
        raise ValueError(f"eps must be > 0 where advantages are divided by the group's std (normalize_std=true): "
                         f"a group whose rewards are all equal has std 0; got eps={args['eps']!r}")


grpo.check_args = _check_eps  # type: ignore[attr-defined]


def rloo(batch: TrainBatch, whiten: bool = False) -> torch.Tensor:
    """RLOO: ``r_i - mean_{j != i} r_j`` over the other samples of the group (0 for a group of one)."""
    import torch

    rewards = batch.sequence_rewards()
    mean, _, count = group_stats(rewards, batch.group_index)
    leave_one_out = torch.where(count > 1, count / (count - 1).clamp(min=1) * (rewards - mean),
                                torch.zeros_like(rewards))
    return _per_token(leave_one_out, batch, whiten)


def _token_rewards(batch: TrainBatch, final: torch.Tensor) -> torch.Tensor:
    """``[B, L-1]``: the sequence reward at its last response token, less the token KL penalties."""
    import torch

    mask = batch.loss_mask
    rewards = torch.zeros_like(mask)
    last = (mask * torch.arange(mask.shape[1])).argmax(dim=1)
    rewards[torch.arange(len(mask)), last] = final
    if batch.kl_penalty is not None:
        rewards = rewards - batch.kl_penalty * mask
    return rewards


def _returns(batch: TrainBatch, final: torch.Tensor, gamma: float) -> torch.Tensor:
    """Discounted return at each response token of the token rewards, summed to the end. Observation
    tokens (loss mask 0, e.g. a tool's output between two turns) are skipped: the return carries over
    them undiscounted, so the tokens before a tool call get the credit of what follows."""
    import torch

    mask, rewards = batch.loss_mask, _token_rewards(batch, final)
    returns = torch.zeros_like(rewards)
    running = torch.zeros(len(mask))
    for t in reversed(range(mask.shape[1])):
        running = torch.where(mask[:, t] > 0, rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return returns * mask


def reinforce_pp(batch: TrainBatch, gamma: float = 1.0, whiten: bool = True) -> torch.Tensor:
    """REINFORCE++: token returns (reward at the end, KL penalty per token) whitened over the batch."""
    advantages = _returns(batch, batch.rewards, gamma)
    return batch_whiten(advantages, batch.loss_mask) if whiten else advantages


def reinforce_pp_baseline(batch: TrainBatch, gamma: float = 1.0, whiten: bool = True) -> torch.Tensor:
    """REINFORCE++ with a baseline: the group mean reward is subtracted before the returns."""
    mean, _, _ = group_stats(batch.rewards, batch.group_index)
    advantages = _returns(batch, batch.rewards - mean, gamma)
    return batch_whiten(advantages, batch.loss_mask) if whiten else advantages


def gspo(batch: TrainBatch, eps: float = 1e-6, whiten: bool = False) -> torch.Tensor:
    """GSPO: GRPO's group-normalised advantage, trained with a sequence-level, length-normalised
    importance ratio and small clip ranges (its ``loss_defaults``)."""
    return grpo(batch, normalize_std=True, eps=eps, whiten=whiten)


gspo.check_args = _check_eps  # type: ignore[attr-defined]
gspo.loss_defaults = {  # type: ignore[attr-defined]
    "ratio": "sequence", "clip_low": 3e-4, "clip_high": 4e-4, "agg": "seq_mean_token_mean",
}


def ppo(batch: TrainBatch, gamma: float = 1.0, lam: float = 0.95, whiten: bool = True) -> torch.Tensor:
    """PPO with GAE: ``delta_t = rew_t + gamma V_{t+1} - V_t``, ``A_t = sum_l (gamma lam)^l delta_{t+l}``
    over the response tokens (observation tokens are skipped), value targets ``A + V`` (set as
    ``batch.returns`` for the value model); advantages whitened over the batch."""
    import torch

    mask, values = batch.loss_mask, batch.values * batch.loss_mask
    rewards = _token_rewards(batch, batch.rewards)
    advantages = torch.zeros_like(mask)
    gae, next_value = torch.zeros(len(mask)), torch.zeros(len(mask))
    for t in reversed(range(mask.shape[1])):
        inside = mask[:, t] > 0
        step = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * gae
        gae = torch.where(inside, step, gae)
        next_value = torch.where(inside, values[:, t], next_value)
        advantages[:, t] = torch.where(inside, step, torch.zeros_like(step))
    batch.returns = (advantages + values) * mask
    return batch_whiten(advantages, mask) if whiten else advantages


ppo.needs_values = True  # type: ignore[attr-defined]  # the loop fills batch.values from the value model


@hookimpl(trylast=True)
def miles_register_advantages(register):
    for estimator in (grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline, gspo, ppo):
        register(estimator.__name__, estimator)
