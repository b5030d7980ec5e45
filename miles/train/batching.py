"""Planning a training step: mini-batches (optimizer steps), data-parallel shares, micro-batches.

A plan is ``plan[mini_batch][rank][micro_batch] -> row indices``. Rows are spread over ranks so that
each rank gets about the same number of tokens, then packed into micro-batches by a sample count or
a token budget. Every rank gets the same number of micro-batches (sharded backends run collectives in
every forward pass); an empty list is a placeholder micro-batch that contributes nothing.

The loss is normalised by each mini-batch's token count over all ranks, so how its samples are
grouped changes neither the loss nor the gradient, only the memory a forward pass needs.
"""

from __future__ import annotations

import heapq

from miles.lazy import lazy_module

torch = lazy_module("torch")

__all__ = ["micro_batch_indices", "balanced_partition", "plan_step", "plan_batch", "normalizers"]

Plan = list[list[list[list[int]]]]


def micro_batch_indices(lengths: torch.Tensor, rows: list[int] | None = None, *, max_samples: int | None = None,
                        max_tokens: int | None = None) -> list[list[int]]:
    """Row indices per micro-batch (of ``rows``, default all).

    With ``max_tokens``, rows are sorted by length and packed so that each micro-batch's padded size
    (rows x longest row) stays within the budget; a row longer than the budget gets a micro-batch of
    its own. Otherwise rows are taken in order, ``max_samples`` at a time.
    """
    rows = list(range(len(lengths))) if rows is None else list(rows)
    if max_tokens is None:
        step = max_samples or len(rows) or 1
        return [rows[i: i + step] for i in range(0, len(rows), step)]
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in sorted(rows, key=lambda r: -int(lengths[r])):
        length = int(lengths[i])
        too_many = max_samples is not None and len(current) >= max_samples
        if current and (too_many or (len(current) + 1) * max(longest, length) > max_tokens):
            groups.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, length)
    if current:
        groups.append(current)
    return groups


def balanced_partition(lengths: torch.Tensor, rows: list[int], parts: int) -> list[list[int]]:
    """Split ``rows`` into ``parts`` shares of about equal token count (longest first, to the lightest share)."""
    shares: list[list[int]] = [[] for _ in range(parts)]
    heap = [(0, rank) for rank in range(parts)]
    for i in sorted(rows, key=lambda r: -int(lengths[r])):
        tokens, rank = heapq.heappop(heap)
        shares[rank].append(i)
        heapq.heappush(heap, (tokens + int(lengths[i]), rank))
    return [sorted(share) for share in shares]


def _equalize(micros: list[list[int]], count: int) -> list[list[int]]:
    """Split the largest micro-batches until there are ``count``, then pad with placeholders."""
    micros = [m for m in micros if m]
    while len(micros) < count:
        largest = max(range(len(micros)), key=lambda k: len(micros[k]), default=None)
        if largest is None or len(micros[largest]) < 2:
            break
        rows = micros.pop(largest)
        micros += [rows[: len(rows) // 2], rows[len(rows) // 2:]]
    return micros + [[] for _ in range(count - len(micros))]


def plan_step(lengths: torch.Tensor, *, world_size: int = 1, mini_batches: int = 1, max_samples: int | None = None,
              max_tokens: int | None = None) -> Plan:
    """The plan for a batch whose rows have ``lengths`` tokens (see the module docstring)."""
    rows = len(lengths)
    mini_batches = max(1, min(mini_batches, rows))
    bounds = [round(k * rows / mini_batches) for k in range(mini_batches + 1)]
    plan: Plan = []
    for k in range(mini_batches):
        shares = balanced_partition(lengths, list(range(bounds[k], bounds[k + 1])), world_size)
        per_rank = [micro_batch_indices(lengths, share, max_samples=max_samples, max_tokens=max_tokens)
                    for share in shares]
        count = max(len(m) for m in per_rank)
        plan.append([_equalize(m, count) for m in per_rank])
    return plan


def plan_batch(batch, options, *, world_size: int = 1, mini_batches: int = 1, epochs: int = 1) -> Plan:
    """:func:`plan_step` for a ``TrainBatch`` with a backend's micro-batch options (``TrainOptions``); with
    ``epochs``, its mini-batches again, in the same order, for each further pass over the batch."""
    plan = plan_step(batch.attention_mask.sum(dim=1), world_size=world_size, mini_batches=mini_batches,
                     max_samples=options.micro_batch_size, max_tokens=options.max_tokens_per_micro_batch)
    return plan * epochs


def normalizers(loss_mask: torch.Tensor, plan: Plan) -> list[tuple[float, float]]:
    """Per mini-batch of ``plan``: its loss tokens and its sequences with loss tokens, over all ranks."""
    out = []
    for mini in plan:
        rows = [r for share in mini for micro in share for r in micro]
        per_row = loss_mask[rows].sum(dim=1)
        out.append((float(per_row.sum()), float((per_row > 0).sum())))
    return out
