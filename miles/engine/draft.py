"""The draft of speculative sampling (:mod:`miles.engine.speculative`): loaded or built for a target, its pushed
weights checked and loaded, and as the running batch holds it: its own K/V cache, in the target's column layout,
built when speculation starts and kept in step with the batch. A separate draft model (:class:`Draft`) reads the
tokens only; a multi-token-prediction head (:class:`MTPDraft`, :mod:`miles.models.mtp`) also the target's hidden
states, which each verifying forward hands it."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from transformers import DynamicCache

from miles.engine import weight_checks
from miles.engine.kv_layout import pack
from miles.engine.speculative import SpeculativeConfig, check_draft, draft_config, draft_distribution, pays
from miles.models import hf
from miles.models.mtp import MultiTokenPredictor, build_head, checkpoint_head

__all__ = ["Draft", "MTPDraft", "make_draft", "load_draft", "check_draft_weights", "load_draft_weights"]

_log = logging.getLogger(__name__)


def load_draft(speculative: SpeculativeConfig, model: Any, model_path: str, tokenizer: Any, seed: int,
               device: torch.device) -> tuple[Any, bool]:
    """The draft of ``speculative`` for the target ``model``: loaded from its directory (the target's tokenizer and
    vocabulary, else a ValueError), or built at random (``seed``) as the target's architecture with smaller sizes;
    and whether decode steps speculate with it (it can pay, or ``speculative.force``)."""
    spec = speculative.draft
    check_draft(speculative, model_path, model.config, tokenizer.get_vocab())
    dtype = next(model.parameters()).dtype
    if "mtp" in spec:
        draft = checkpoint_head(model_path, model.config, dtype=dtype)
        if draft is None:
            _log.info("speculative draft: the checkpoint ships no MTP head; one is built at random (seed %d)", seed)
            draft = build_head(model.config, seed, dtype=dtype)
    elif "path" in spec:
        draft = hf.load_model(spec["path"], dtype=dtype)
    else:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            draft = hf.causal_lm_from_config(draft_config(model.config, spec["build"]), dtype=dtype)
    draft = draft.to(device).eval()
    draft.requires_grad_(False)
    target_params = sum(p.numel() for p in model.parameters())
    draft_params = sum(p.numel() for p in draft.parameters())
    if isinstance(draft, MultiTokenPredictor):  # it reads the target's output layer at each proposal
        draft_params += model.get_output_embeddings().weight.numel()
    can_pay, speedup = pays(target_params, draft_params, speculative.num_tokens)
    if not (can_pay or speculative.force):  # the draft is still held: its pushed weights load, for when it is on
        _log.warning("speculative decoding is off: a draft of %d parameters for a target of %d cannot pay "
                     "(estimated %.2fx at 70%% acceptance: each forward's fixed cost dominates); set "
                     "speculative.force: true to speculate anyway", draft_params, target_params, speedup)
    return draft, can_pay or speculative.force


def check_draft_weights(draft: Any, weights: dict[str, torch.Tensor], allow_non_finite: bool) -> None:
    """Pushed draft weights (all of them) are checked as the target's are; a ValueError applies nothing."""
    if draft is None:
        raise ValueError("weight update refused, nothing was applied: it holds draft weights (draft.*) and "
                         "this engine has no draft (rollout.engine.speculative)")
    if problems := weight_checks.weight_problems(draft.state_dict(), weights, allow_non_finite):
        raise ValueError(f"weight update refused, nothing was applied: the draft's: {'; '.join(problems)}")


def load_draft_weights(draft: Any, weights: dict[str, torch.Tensor], held: Draft | None) -> None:
    """Copy checked ``weights`` into ``draft`` (the caller holds the step lock); the batch's ``held`` draft drops
    the K/V of the old weights."""
    current = draft.state_dict()
    with torch.no_grad():
        for name, tensor in weights.items():
            current[name].copy_(tensor)
    if held is not None:
        held.reset()


def _propose(logits: torch.Tensor, settings: tuple[torch.Tensor, ...], generator: torch.Generator | None,
             never_generated: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A proposal per row ([B]) drawn from the draft's ``logits`` [B, V] as the rows sample, and that distribution."""
    finite = torch.isfinite(logits).all(dim=-1, keepdim=True)
    logits = torch.where(finite, logits, torch.zeros_like(logits))  # a broken draft proposes at random
    if never_generated is not None:
        logits = logits.index_fill(1, never_generated, float("-inf"))
    q = draft_distribution(logits, *settings)
    return torch.multinomial(q, 1, generator=generator).squeeze(1), q


def _placed(fed: list[list[int]], mask: torch.Tensor, pad: int) -> torch.Tensor:
    """Each row's ``fed`` tokens in the columns ``mask`` [B, T] attends, ``pad`` elsewhere."""
    ids = torch.full(mask.shape, pad, dtype=torch.long, device=mask.device)
    for row, tokens in enumerate(fed):
        cols = mask[row].nonzero().squeeze(1)
        ids[row, cols] = torch.tensor(tokens, dtype=torch.long, device=mask.device)
    return ids


def make_draft(model: Any, target: Any, pad_token_id: int) -> Draft:
    """How the running batch holds the draft ``model`` of ``target``."""
    if isinstance(model, MultiTokenPredictor):
        return MTPDraft(model, target, pad_token_id)
    return Draft(model, pad_token_id)


class Draft:
    def __init__(self, model: Any, pad_token_id: int) -> None:
        self.model, self.pad = model, pad_token_id
        self.cache: DynamicCache | None = None  # None: to be built from the rows' tokens

    def reset(self) -> None:
        self.cache = None

    def watching(self, target: Any) -> contextlib.AbstractContextManager[Any]:
        """Around the target's verifying forward: what :meth:`verified` is handed (nothing for a draft model)."""
        return contextlib.nullcontext()

    def verified(self, ids: torch.Tensor, seen: Any, mask: torch.Tensor, positions: torch.Tensor,
                 taken: torch.Tensor) -> None:
        """After the target's verifying forward over ``ids`` [B, k + 1] (``seen``: what :meth:`watching` caught)
        the rows took ``taken`` [B] of them; a draft model's cache already holds their columns."""

    @torch.inference_mode()
    def build(self, fed: list[list[int]], mask: torch.Tensor) -> None:
        """Prefill the draft with each row's ``fed`` tokens (the prompt and the outputs before the pending one)
        placed in the columns ``mask`` [B, T] attends, so that its cache lines up with the target's."""
        ids = _placed(fed, mask, self.pad)
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
            token, q = _propose(logits, settings, generator, never_generated)
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


class _Seen:
    hidden: torch.Tensor | None = None


class MTPDraft(Draft):
    """An MTP head (:class:`~miles.models.mtp.MultiTokenPredictor`) as the batch holds it. Its cache column for a
    token holds the head's K/V of that token with the target's hidden state before it; proposals chain the head's
    own output in place of the target's, and once the target has verified them, their columns are computed again
    from the target's hidden states. Building the cache (when speculation starts or rows join) runs the target over
    the rows' tokens once for their hidden states."""

    def __init__(self, head: MultiTokenPredictor, target: Any, pad_token_id: int) -> None:
        super().__init__(head, pad_token_id)
        self.target = target
        self.last: torch.Tensor | None = None  # [B, H]: the target's hidden state before each row's pending token

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.target.get_input_embeddings()(ids)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.get_output_embeddings()(hidden)

    @torch.inference_mode()
    def build(self, fed: list[list[int]], mask: torch.Tensor) -> None:
        ids = _placed(fed, mask, self.pad)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        hidden = self.target.get_decoder()(input_ids=ids, attention_mask=mask,
                                           position_ids=positions).last_hidden_state
        before = torch.zeros_like(hidden)  # each column takes the hidden state of the row's column before it
        self.last = hidden.new_zeros((hidden.shape[0], hidden.shape[2]))
        for row in range(mask.shape[0]):
            cols = mask[row].nonzero().squeeze(1)
            before[row, cols[1:]] = hidden[row, cols[:-1]]
            self.last[row] = hidden[row, cols[-1]]
        self.cache = DynamicCache()
        self.model(self._embed(ids), before, mask, positions, self.cache)

    @torch.inference_mode()
    def propose(self, pending: torch.Tensor, mask: torch.Tensor, k: int,
                settings: tuple[torch.Tensor, ...], generator: torch.Generator | None,
                never_generated: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        width = mask.shape[1] - (k + 1)
        start = mask[:, :width].sum(dim=1)
        token, hidden, proposals, dists = pending, self.last, [], []
        for j in range(k):  # the last proposal's column is fed in `verified`, with the target's hidden state
            out = self.model(self._embed(token.unsqueeze(1)), hidden.unsqueeze(1), mask[:, : width + j + 1],
                             (start + j).unsqueeze(1), self.cache)
            hidden = out[:, -1]
            token, q = _propose(self._logits(hidden).float(), settings, generator, never_generated)
            proposals.append(token)
            dists.append(q)
        return torch.stack(proposals, dim=1), torch.stack(dists, dim=1)

    @contextlib.contextmanager
    def watching(self, target: Any) -> Iterator[_Seen]:
        seen = _Seen()

        def hook(module: Any, args: Any, output: Any) -> None:
            seen.hidden = output.last_hidden_state

        handle = target.get_decoder().register_forward_hook(hook)
        try:
            yield seen
        finally:
            handle.remove()

    @torch.inference_mode()
    def verified(self, ids: torch.Tensor, seen: Any, mask: torch.Tensor, positions: torch.Tensor,
                 taken: torch.Tensor) -> None:
        width = mask.shape[1] - ids.shape[1]
        for layer in self.cache.layers:  # the proposals' chained columns, computed again from the target's
            layer.keys, layer.values = layer.keys[:, :, :width], layer.values[:, :, :width]
        hidden = seen.hidden
        before = torch.cat([self.last.unsqueeze(1), hidden[:, :-1]], dim=1)
        self.model(self._embed(ids), before, mask, positions, self.cache)
        self.last = hidden[torch.arange(len(taken), device=hidden.device), taken - 1]

    def reset(self) -> None:
        self.cache, self.last = None, None

    def keep(self, index: torch.Tensor, lead: int) -> None:
        super().keep(index, lead)
        if self.last is not None:
            self.last = self.last[index]
