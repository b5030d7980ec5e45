"""The draft model of speculative sampling (:mod:`miles.engine.speculative`) as the running batch holds it: its own
K/V cache, in the target's column layout, built when speculation starts and kept in step with the batch."""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from miles.engine.kv_layout import pack
from miles.engine.speculative import draft_distribution

__all__ = ["Draft"]


class Draft:
    def __init__(self, model: Any, pad_token_id: int) -> None:
        self.model, self.pad = model, pad_token_id
        self.cache: DynamicCache | None = None  # None: to be built from the rows' tokens

    def reset(self) -> None:
        self.cache = None

    @torch.inference_mode()
    def build(self, fed: list[list[int]], mask: torch.Tensor) -> None:
        """Prefill the draft with each row's ``fed`` tokens (the prompt and the outputs before the pending one)
        placed in the columns ``mask`` [B, T] attends, so that its cache lines up with the target's."""
        ids = torch.full(mask.shape, self.pad, dtype=torch.long, device=mask.device)
        for row, tokens in enumerate(fed):
            cols = mask[row].nonzero().squeeze(1)
            ids[row, cols] = torch.tensor(tokens, dtype=torch.long, device=mask.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        self.cache = DynamicCache()
        self.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=self.cache, use_cache=True,
                   logits_to_keep=1)

    @torch.inference_mode()
    def propose(self, pending: torch.Tensor, mask: torch.Tensor, k: int,
                settings: tuple[torch.Tensor, ...], generator: torch.Generator | None,
                never_generated: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``k`` proposals per row ([B, k]) and the distributions they were drawn from ([B, k, V]). The draft is
        fed the pending token and every proposal (k + 1 columns, as the target will be); ``mask`` [B, T + k + 1]
        is the batch's mask with those columns."""
        width = mask.shape[1] - (k + 1)
        # the draft's own positions: the tokens it holds (a vision-language target's count images otherwise)
        start = mask[:, :width].sum(dim=1)
        token, proposals, dists = pending, [], []
        for j in range(k + 1):
            logits = self.model(input_ids=token.unsqueeze(1), attention_mask=mask[:, : width + j + 1],
                                position_ids=(start + j).unsqueeze(1), cache=self.cache,
                                use_cache=True).logits[:, -1, :].float()
            if j == k:  # the last proposal's column: the target scores it, the draft only holds it
                break
            finite = torch.isfinite(logits).all(dim=-1, keepdim=True)
            logits = torch.where(finite, logits, torch.zeros_like(logits))  # a broken draft proposes at random
            if never_generated is not None:
                logits = logits.index_fill(1, never_generated, float("-inf"))
            q = draft_distribution(logits, *settings)
            token = torch.multinomial(q, 1, generator=generator).squeeze(1)
            proposals.append(token)
            dists.append(q)
        return torch.stack(proposals, dim=1), torch.stack(dists, dim=1)

    def keep(self, index: torch.Tensor, lead: int) -> None:
        """The rows ``index`` only, without the first ``lead`` columns (as the batch's ``_keep``)."""
        if self.cache is not None:
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[index, :, lead:], layer.values[index, :, lead:]

    def pack(self, mask: torch.Tensor, span: int) -> None:
        """Move each row's attended columns to the right of ``span`` columns (as the target's cache is packed)."""
        if self.cache is not None:
            pack(self.cache, mask, list(range(mask.shape[0])), span)
