"""Splitting a training batch into micro-batches: a fixed number of samples, or a token budget.

The loss is normalised by the whole batch's token count, so how samples are grouped does not
change the gradient, only the memory a forward pass needs.
"""

from __future__ import annotations

import torch

__all__ = ["micro_batch_indices"]


def micro_batch_indices(lengths: torch.Tensor, *, max_samples: int | None = None,
                        max_tokens: int | None = None) -> list[list[int]]:
    """Row indices per micro-batch.

    With ``max_tokens``, rows are sorted by length and packed first-fit so that each micro-batch's
    padded size (rows x longest row) stays within the budget; a row longer than the budget gets a
    micro-batch of its own. Otherwise rows are taken in order, ``max_samples`` at a time.
    """
    rows = len(lengths)
    if max_tokens is None:
        step = max_samples or rows or 1
        return [list(range(i, min(i + step, rows))) for i in range(0, rows, step)]
    order = sorted(range(rows), key=lambda i: -int(lengths[i]))
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        length = int(lengths[i])
        if current and (len(current) + 1) * max(longest, length) > max_tokens:
            groups.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, length)
    if current:
        groups.append(current)
    return groups
