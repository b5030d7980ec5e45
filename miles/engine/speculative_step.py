"""The speculative decode step of :class:`~miles.engine.batcher.ContinuousBatcher`: the draft
(:mod:`miles.engine.draft`) proposes ``k`` tokens per row, the target scores them in one forward, and each row takes
what :func:`~miles.engine.speculative.accept` keeps. It steps the batcher's own state, so it is written as a part of
that class, kept here because only a speculative engine runs it."""

from __future__ import annotations

from typing import Any

import torch

from miles.engine.kv_layout import pack
from miles.engine.outputs import take_tokens
from miles.engine.speculative import accept, draft_distribution
from miles.models.sampling import scaled_logits, truncated_logits

__all__ = ["SpeculativeStep", "SPEC_STATS"]

# speculative steps' counts: steps, target forwards of a row, proposals made, kept, and the tokens the rows took
SPEC_STATS = ("spec_steps", "spec_row_forwards", "spec_proposed", "spec_accepted", "spec_tokens")


class SpeculativeStep:
    """Mixed into the batcher; uses its rows, caches, mask, positions, pending tokens and settings."""

    _rows: list[Any]
    _mask: torch.Tensor

    @torch.inference_mode()
    def _speculative_decode(self: Any) -> None:
        """One target forward over each row's pending token and the draft's ``k`` proposals; each row takes the
        proposals :func:`~miles.engine.speculative.accept` keeps and the token after them (1 to k + 1 tokens). The
        columns of the proposals it did not take stay in the caches, masked."""
        k, batch = self.speculative.num_tokens, len(self._rows)
        if self.draft.cache is None:
            self.draft.build([r.prompt + r.output_ids[:-1] for r in self._rows], self._mask)
        width = self._mask.shape[1]
        mask = torch.cat([self._mask, torch.ones((batch, k + 1), dtype=torch.long, device=self.device)], dim=1)
        proposals, q = self.draft.propose(self._pending, mask, k, self._settings, self.generator,
                                          self.never_generated)
        ids = torch.cat([self._pending.unsqueeze(1), proposals], dim=1)
        positions = self._next_pos.unsqueeze(1) + torch.arange(k + 1, device=self.device)
        with self._routing(self._rows) as record, self.draft.watching(self.model) as seen:
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=self._cache,
                                use_cache=True).logits.float()  # [B, k + 1, V]
        finite = torch.isfinite(logits).all(dim=-1).all(dim=-1)
        if not bool(finite.all()):
            logits = torch.where(finite[:, None, None], logits, torch.zeros_like(logits))
        if self.never_generated is not None:
            logits = logits.index_fill(2, self.never_generated, float("-inf"))
        settings = tuple(t.unsqueeze(1).expand(-1, k + 1) for t in self._settings)
        kept, after = accept(draft_distribution(logits, *settings), q, proposals, self.generator)
        tokens = torch.cat([proposals, proposals[:, :1]], dim=1).scatter(1, kept.unsqueeze(1), after.unsqueeze(1))
        reported = logits if self.logprobs_of == "model" else scaled_logits(logits, settings[0])
        if self.logprobs_of == "truncated":
            reported = truncated_logits(reported, *settings)
        # the caller holds step_lock: no update lands in this step
        taken = take_tokens(self._rows, tokens, reported, finite, kept + 1, self.version())
        taken_t = torch.tensor(taken, device=self.device)
        if record is not None:
            routed = record.routed(batch).cpu()
            for r, ids_, n in zip(self._rows, routed, taken):
                if r.return_routed_experts and n:
                    r.routed.append(ids_[:n])
        self.draft.verified(ids, seen, mask, positions, taken_t)
        mask[:, width:] = (torch.arange(k + 1, device=self.device) < taken_t.unsqueeze(1)).long()
        self._mask = mask
        self._next_pos = self._next_pos + taken_t
        self._pending = tokens.gather(1, (taken_t - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
        self._count(k, batch, kept, taken)
        self._pack_holes(k)
        self._retire(0)

    def _count(self: Any, k: int, batch: int, kept: torch.Tensor, taken: list[int]) -> None:
        self.stats["decode_steps"] += 1
        self.stats["spec_steps"] += 1
        self.stats["spec_row_forwards"] += batch
        # a proposal counts where the row could use it: not after its stop token or its last token
        considered = [k if r.finish is None else min(k, n) for r, n in zip(self._rows, taken)]
        self.stats["spec_proposed"] += sum(considered)
        self.stats["spec_accepted"] += sum(min(int(n), c) for n, c in zip(kept.tolist(), considered))
        self.stats["spec_tokens"] += sum(taken)

    def _pack_holes(self: Any, k: int) -> None:
        """Pack both caches once the masked columns of refused proposals exceed a few steps' worth."""
        span = int(self._mask.sum(dim=1).max())
        if self._mask.shape[1] - span > 4 * (k + 1):
            self.draft.pack(self._mask, span)
            self._mask = pack(self._cache, self._mask, list(range(len(self._rows))), span)
