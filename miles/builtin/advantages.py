"""Builtin advantage estimators."""

from __future__ import annotations

import torch

from miles import hookimpl
from miles.types import TrainBatch


def group_stats(values: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row group mean, unbiased std (0 for groups of one) and group size."""
    _, inverse = group_index.unique(return_inverse=True)
    groups = int(inverse.max().item()) + 1
    count = torch.zeros(groups).index_add_(0, inverse, torch.ones_like(values))
    mean = torch.zeros(groups).index_add_(0, inverse, values) / count
    centered = values - mean[inverse]
    sq = torch.zeros(groups).index_add_(0, inverse, centered**2)
    std = torch.where(count > 1, (sq / (count - 1).clamp(min=1)).sqrt(), torch.zeros_like(count))
    return mean[inverse], std[inverse], count[inverse]


def grpo(batch: TrainBatch, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantage: ``(r - mean_group(r)) / (std_group(r) + eps)``, per sequence.

    ``std`` is the unbiased standard deviation of the group's rewards; with ``normalize_std=False``
    only the mean is subtracted. The value is broadcast over the sequence's response tokens.
    """
    mean, std, _ = group_stats(batch.rewards, batch.group_index)
    advantage = batch.rewards - mean
    if normalize_std:
        advantage = advantage / (std + eps)
    return advantage.unsqueeze(1) * batch.loss_mask


@hookimpl(trylast=True)
def miles_register_advantages(register):
    register("grpo", grpo)
