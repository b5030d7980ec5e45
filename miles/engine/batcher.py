"""Continuous batching: requests join and leave the running batch at every decode step.

One worker thread owns the model's forward passes. Each iteration admits the queued requests
(prefilled together, left-padded), merges their KV cache into the running batch, feeds every row's
last sampled token, samples the next, and retires finished rows. Weight updates take the same lock
as a step, so no request is ever served by half-updated weights.

With a prefix cache (:mod:`miles.engine.prefix_cache`), an admitted prompt starts from the K/V of its
longest held prefix and only the rest is run through the model; rows with the same prompt in one
admission are computed once. Prompts are held after prefill, and prompt + output when a row retires.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
from transformers import DynamicCache

from miles.engine.image_input import prefill_vision_inputs
from miles.engine.kv_layout import left_pad, pack, past_block
from miles.engine.prefix_cache import PrefixCache
from miles.engine.draft import make_draft
from miles.engine.outputs import fill_prompt_logprobs, take_tokens
from miles.engine.request import Request, answer, clear_outputs, plain_answer
from miles.engine.sampling import RowSampling, per_position, sample_next
from miles.engine.speculative import SpeculativeConfig
from miles.engine.speculative_step import SPEC_STATS, SpeculativeStep
from miles.models.hf import exact_logprobs
from miles.models.moe import moe_layout, routing

__all__ = ["ContinuousBatcher", "Request", "SPEC_STATS"]

_log = logging.getLogger(__name__)


class ContinuousBatcher(SpeculativeStep):
    def __init__(self, model: Any, tokenizer: Any, *, context_length: int, pad_token_id: int, eos_token_id: int,
                 generator: torch.Generator, max_batch_size: int, version: Callable[[], int],
                 background: bool = True, prefix_cache_tokens: int = 0, exact_logprobs: bool = False,
                 logprobs_of: str = "sampling", speculative: SpeculativeConfig | None = None,
                 draft: Any = None) -> None:
        self.model, self.tokenizer = model, tokenizer
        # rollout.engine.speculative: a draft proposes, the target verifies (miles.engine.speculative)
        self.speculative = speculative
        self.draft = make_draft(draft, model, pad_token_id) if speculative is not None else None
        self.logprobs_of = logprobs_of  # the distribution of the log-probs, top log-probs and entropy it reports
        # rollout.true_on_policy: each answer's log-probs computed again as the trainer computes them (bit for bit)
        self.exact_logprobs = exact_logprobs
        self.device = next(model.parameters()).device  # every tensor of the batch lives beside the weights
        self.context_length, self.pad, self.eos = context_length, pad_token_id, eos_token_id
        self.generator, self.max_batch_size, self.version = generator, max_batch_size, version
        self.step_lock = threading.Lock()  # held for each step and by weight updates
        self.prefix_cache = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens > 0 else None
        self.moe = moe_layout(model)  # None for a dense model
        self.never_generated: torch.Tensor | None = None  # token ids a policy never samples (set by the engine)
        self._epoch = 0  # bumped by each clear of the prefix cache
        # prefill_tokens_requested: prompt tokens admitted; _computed: those run through the model (the rest came
        # from the prefix cache); prefix_cache_tokens: held now; requests_aborted: answered early by an abort (a
        # client that went away included); requests_failed: answered early because processing them raised
        self.stats = {"prefill_batches": 0, "decode_steps": 0, "requests_finished": 0, "requests_aborted": 0,
                      "requests_failed": 0, "prefill_tokens_requested": 0, "prefill_tokens_computed": 0,
                      "prefix_cache_tokens": 0, **{name: 0 for name in SPEC_STATS}}
        self._cond = threading.Condition()
        self._queue: list[Request] = []
        self._admitting: list[Request] = []  # taken off the queue, not yet rows: an abort must still reach them
        self._abort_pending = False  # a request was aborted since the worker last looked: it looks (not every step)
        self._paused = False
        self._closed = False
        self._rows: list[Request] = []
        self._cache: DynamicCache | None = None
        self._mask = torch.zeros((0, 0), dtype=torch.long, device=self.device)  # [B, T]
        # [B] position of each row's pending token
        self._next_pos = torch.zeros(0, dtype=torch.long, device=self.device)
        self._pending = torch.zeros(0, dtype=torch.long, device=self.device)  # [B] sampled, not yet fed
        self._settings = self._settings_of([])  # [B] each: temperature, top_p, top_k of each row
        self._row_sampling: tuple[tuple[torch.Tensor, ...], RowSampling] | None = None  # of the settings it names
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, name="miles-engine", daemon=True)
            self._thread.start()

    # -- control (any thread) -----------------------------------------------------------------------

    def submit(self, requests: list[Request]) -> None:
        for r in requests:
            r.budget = min(r.params.max_new_tokens, self.context_length - len(r.prompt))
            r.stop_ids = frozenset(r.params.stop_token_ids) | (frozenset() if r.params.ignore_eos else {self.eos})
        with self._cond:
            self._queue.extend(requests)
            self._cond.notify()

    def abort(self, rid: str | None = None) -> int:
        """Finish the request ``rid`` (every request when None) with what it has so far."""
        with self._cond:
            pending = {id(r): r for r in self._queue + self._admitting + self._rows}
            hits = [r for r in pending.values() if rid is None or r.rid == rid]
            for r in hits:
                r.aborted = True
            self._abort_pending = self._abort_pending or bool(hits)
            self._cond.notify()
        return len(hits)

    def cancel(self, request: Request) -> None:
        """Abort ``request`` itself (its caller went away), wherever it is: queued, being admitted or running."""
        with self._cond:
            request.aborted = True
            self._abort_pending = True
            self._cond.notify()

    def pause(self) -> None:
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify()

    def clear_prefix_cache(self) -> None:
        """Drop every held prefix, and never store K/V of rows admitted before; the caller holds ``step_lock``."""
        self._epoch += 1
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        self.stats["prefix_cache_tokens"] = 0

    def load(self) -> dict[str, int]:
        """Requests waiting to be admitted, and rows in the running batch."""
        with self._cond:
            return {"waiting_requests": len(self._queue), "running_requests": len(self._rows)}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # -- the worker -----------------------------------------------------------------------------------

    def drain(self) -> None:
        """Without a worker thread: step in the calling thread until nothing is queued or running."""
        while self._queue or self._rows:
            self._iteration()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._closed or self._abort_pending or (not self._paused and (self._queue or self._rows))):
                    self._cond.wait()
                if self._closed:
                    return
            self._iteration()

    def _iteration(self) -> None:
        """Retire aborted rows, admit what fits, take one decode step. An error raised for one request fails that
        request only (see :meth:`_admit_each` and :meth:`_retire`); what is left is the running batch's own
        forward pass, whose failure fails the rows in flight: the engine serves on."""
        with self._cond:
            aborts, self._abort_pending = self._abort_pending, False  # one set later is seen by the next iteration
            if aborts:
                self._queue = [r for r in self._queue if not self._finish_if_aborted(r)]
            room = 0 if self._paused else max(0, self.max_batch_size - len(self._rows))
            admitted, self._queue = self._queue[:room], self._queue[room:]
            self._admitting = admitted
            paused = self._paused
        with self.step_lock:
            try:
                if aborts:
                    self._retire_aborted()
                admitted = [r for r in admitted if not self._finish_if_aborted(r)]  # aborted on the way
                if admitted:
                    self._admit_each(admitted)
                if self._rows and not paused:
                    self._decode()
            except Exception as exc:  # the batch's step, not one request's: fail what is in flight; keep serving
                _log.exception("a decode step of %d rows failed; their requests are answered with an abort",
                               len(self._rows))
                for r in admitted + self._rows:
                    if r.finish is None:
                        self._fail(r, exc)
                self._reset()
            finally:
                with self._cond:
                    self._admitting = []

    def _reset(self) -> None:
        if self.draft is not None:
            self.draft.reset()
        self._rows, self._cache = [], None
        self._mask = torch.zeros((0, 0), dtype=torch.long, device=self.device)
        self._next_pos = torch.zeros(0, dtype=torch.long, device=self.device)
        self._pending = torch.zeros(0, dtype=torch.long, device=self.device)
        self._settings = self._settings_of([])

    def _settings_of(self, requests: list[Request]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[B] each: the temperature, top_p and top_k of ``requests``, made once when they are admitted."""
        params = [r.params for r in requests]
        return (torch.tensor([float(p.temperature) for p in params], dtype=torch.float32, device=self.device),
                torch.tensor([float(p.top_p) for p in params], dtype=torch.float32, device=self.device),
                torch.tensor([p.top_k for p in params], dtype=torch.long, device=self.device))

    def _fail(self, r: Request, exc: Exception) -> None:
        """Answer ``r`` early with an abort naming ``exc`` (raised while processing it)."""
        r.finish = {"type": "abort", "message": f"{type(exc).__name__}: {exc}"}
        self.stats["requests_failed"] += 1
        self._deliver(r, failed=True)

    def _deliver(self, r: Request, text: str | None = None, *, failed: bool = False) -> None:
        """Hand ``r``'s answer to its caller. Making the answer may raise for this request alone (its text,
        its log-probs computed again): it is then answered with what it has and an abort naming the error."""
        try:
            reply = self._answer(r, text)
        except Exception as exc:
            _log.exception("answering request %s failed", r.rid)
            self.stats["requests_failed"] += 0 if failed else 1  # counted once
            r.finish = {"type": "abort", "message": f"{type(exc).__name__}: {exc}"}
            reply = plain_answer(r, self.version())
        try:
            r.deliver(reply)
        except Exception:  # the caller's own callback: nothing more to tell it
            _log.exception("delivering the answer of request %s failed", r.rid)

    def _finish_if_aborted(self, r: Request) -> bool:
        if r.aborted and r.finish is None:
            r.finish = {"type": "abort", "message": "aborted"}
            self.stats["requests_aborted"] += 1
            self._deliver(r)
        return r.aborted

    def _retire_aborted(self) -> None:
        if any(r.aborted for r in self._rows):
            for r in self._rows:
                self._finish_if_aborted(r)
            self._keep([i for i, r in enumerate(self._rows) if not r.aborted])

    def _admit_each(self, requests: list[Request]) -> None:
        """Admit ``requests`` together; when that raises, each alone, so that a request whose admission raises
        (parameters out of range, a prompt the model cannot take) fails by itself. A failed admission leaves the
        running batch as it was."""
        ready = []
        for r in requests:
            try:
                r.params.check()  # parse checked them; a Request made directly may hold anything
            except Exception as exc:
                self._fail(r, exc)
            else:
                ready.append(r)
        first = len(self._rows)
        try:
            if ready:
                self._admit(ready)
        except Exception as exc:
            if len(ready) == 1:
                self._fail_admission(ready[0], exc)
            else:
                _log.warning("admitting %d requests together failed (%s: %s); admitting them one by one",
                             len(ready), type(exc).__name__, exc)
                for r in ready:
                    try:
                        self._admit([r])
                    except Exception as alone:
                        self._fail_admission(r, alone)
        self._retire(first)  # those that finished at their first token

    def _fail_admission(self, r: Request, exc: Exception) -> None:
        _log.warning("request %s failed at admission: %s: %s", r.rid, type(exc).__name__, exc)
        clear_outputs(r)  # it generated nothing
        self._fail(r, exc)

    @torch.inference_mode()
    def _admit(self, requests: list[Request]) -> None:
        """Prefill ``requests`` together and merge them into the running batch.

        Row u of the prefill starts from its held prefix (``hits[u]``, h tokens; never the whole prompt, whose last
        token gives the next-token logits): the held K/V sit right-aligned in a past block as wide as the longest
        hit, the uncached suffixes follow left-padded, and the mask has a hole between a row's prefix and its
        suffix; positions count from h. Afterwards each row's attended columns are packed to the right, so the
        running batch looks as if the prompts had been prefilled whole. Until the merge at the end, nothing of the
        running batch changes: a request that makes this raise can be admitted again, alone.
        """
        for r in requests:
            clear_outputs(r)
        settings = self._settings_of(requests)
        prompt_logprobs = [r.return_logprob and r.logprob_start_len >= 0 for r in requests]
        # computed whole: prompt log-probs, or expert ids (the prefix cache holds K/V, not routing)
        wanted = [p or r.return_routed_experts for r, p in zip(requests, prompt_logprobs)]
        unique: list[Request] = []  # the rows computed; request i is computed as unique[of[i]]
        full: list[bool] = []  # computed without the cache
        of: list[int] = []
        index: dict[Any, int] = {}
        for i, (r, w) in enumerate(zip(requests, wanted)):
            key = i if self.prefix_cache is None else tuple(r.cache_key)
            if key not in index:
                index[key] = len(unique)
                unique.append(r)
                full.append(False)
            of.append(index[key])
            full[of[-1]] |= w
        hits = [self._match(r) if self.prefix_cache is not None and not f else (0, None)
                for r, f in zip(unique, full)]
        past = max(h for h, _ in hits)
        suffixes = [r.prompt[h:] for r, (h, _) in zip(unique, hits)]
        width = max(len(s) for s in suffixes)
        ids = torch.tensor([[self.pad] * (width - len(s)) + s for s in suffixes], device=self.device)
        mask = torch.tensor([[0] * (past - h) + [1] * h + [0] * (width - len(s)) + [1] * len(s)
                             for (h, _), s in zip(hits, suffixes)], device=self.device)
        cache = DynamicCache(past_block(hits, past)) if past else DynamicCache()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, past:]
        vision = {}
        if unique[0].positions is not None:  # a vision-language model: multimodal positions, images not held
            positions, vision = prefill_vision_inputs(unique, [h for h, _ in hits], width, self.device)
        with self._routing(requests) as record:
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache,
                                use_cache=True, logits_to_keep=0 if any(prompt_logprobs) else 1, **vision).logits
        if record is not None:
            routed = record.routed(len(unique))
            for r, u in zip(requests, of):
                if r.return_routed_experts:  # computed whole: the prompt is the suffix
                    r.routed.append(routed[u, width - len(r.prompt):].cpu())
        for r, u, p in zip(requests, of, prompt_logprobs):
            if p:  # computed whole: the prompt is the suffix
                fill_prompt_logprobs(r, logits[u, width - len(r.prompt) : width - 1].float())
        for r in requests:
            r.epoch = self._epoch
        if self.prefix_cache is not None:
            for u, r in enumerate(unique):
                self._store(r.cache_key, cache, u, mask[u])
            if past or len(unique) < len(requests):
                mask = pack(cache, mask, of, max(len(r.prompt) for r in requests))
                logits = logits[of]
        tokens = self._sample(logits[:, -1, :].float(), requests, settings)
        next_pos = torch.tensor([len(r.prompt) + r.delta for r in requests], device=self.device)
        self._merge(requests, cache, mask, next_pos, tokens, settings)
        self.stats["prefill_batches"] += 1
        self.stats["prefill_tokens_requested"] += sum(len(r.prompt) for r in requests)
        self.stats["prefill_tokens_computed"] += sum(len(s) for s in suffixes)

    def _match(self, r: Request) -> tuple[int, torch.Tensor | None]:
        """``r``'s longest held prefix short of its whole prompt, never ending inside an image (encoded whole)."""
        key = r.cache_key
        held, kv = self.prefix_cache.match(key, len(key) - 1)
        for start, end in r.spans:
            if start < held < end:
                return self.prefix_cache.match(key, start)
        return held, kv

    def _merge(self, requests: list[Request], cache: DynamicCache, mask: torch.Tensor, next_pos: torch.Tensor,
               tokens: torch.Tensor, settings: tuple[torch.Tensor, ...]) -> None:
        """Append the prefilled ``requests`` to the running batch; everything is made before anything is replaced."""
        if self.draft is not None:  # built again, with the new rows, at the next speculative step
            self.draft.reset()
        if self._cache is None:
            self._cache, self._mask, self._next_pos, self._pending = cache, mask, next_pos, tokens
            self._settings, self._rows = settings, self._rows + requests
            return
        span = max(self._mask.shape[1], mask.shape[1])
        layers = [(torch.cat([left_pad(mine.keys, span), left_pad(theirs.keys, span)]),
                   torch.cat([left_pad(mine.values, span), left_pad(theirs.values, span)]))
                  for mine, theirs in zip(self._cache.layers, cache.layers)]
        merged_mask = torch.cat([left_pad(self._mask, span), left_pad(mask, span)])
        merged = [torch.cat([mine, theirs]) for mine, theirs in
                  zip((self._next_pos, self._pending, *self._settings), (next_pos, tokens, *settings))]
        for layer, (keys, values) in zip(self._cache.layers, layers):
            layer.keys, layer.values = keys, values
        self._mask, (self._next_pos, self._pending, *rest) = merged_mask, merged
        self._settings = tuple(rest)
        self._rows = self._rows + requests

    def _store(self, tokens: list[int], cache: DynamicCache, row: int, mask: torch.Tensor) -> None:
        """Hold ``tokens`` in the prefix cache with their K/V: the columns of ``cache``'s ``row`` that ``mask``
        attends. Only the K/V of the tokens not held yet are copied (most often none, or an answer's few tokens)."""
        held = self.prefix_cache.held(tokens)
        if held >= min(len(tokens), self.prefix_cache.max_tokens):
            return
        cols = mask.nonzero().squeeze(1)
        if len(cols) != len(tokens):  # not this row's K/V: never store it
            return
        cols = cols[held:]
        kv = torch.stack([torch.stack([layer.keys[row][:, cols], layer.values[row][:, cols]])
                          for layer in cache.layers])
        self.prefix_cache.insert(tokens, kv, start=held)
        self.stats["prefix_cache_tokens"] = self.prefix_cache.tokens

    @torch.inference_mode()
    def _decode(self) -> None:
        if self.speculative is not None and self.speculative.active(len(self._rows)):
            self._speculative_decode()
            return
        if self.draft is not None:  # its cache misses this step's column: built again when speculation resumes
            self.draft.reset()
        batch = len(self._rows)
        column = torch.ones((batch, 1), dtype=torch.long, device=self.device)
        self._mask = torch.cat([self._mask, column], dim=1)
        with self._routing(self._rows) as record:
            logits = self.model(input_ids=self._pending.unsqueeze(1), attention_mask=self._mask,
                                position_ids=self._next_pos.unsqueeze(1), cache=self._cache,
                                use_cache=True).logits[:, -1, :].float()
        if record is not None:
            routed = record.routed(batch)[:, 0].cpu()
            for r, ids in zip(self._rows, routed):
                if r.return_routed_experts:
                    r.routed.append(ids.unsqueeze(0))
        self.stats["decode_steps"] += 1
        self._next_pos = self._next_pos + 1
        self._pending = self._sample(logits, self._rows, self._settings)
        self._retire(0)

    def _routing(self, rows: list[Request]) -> Any:
        """Record the routers' choices in this forward pass when a row asks for them."""
        if self.moe is None or not any(r.return_routed_experts for r in rows):
            return contextlib.nullcontext()
        return routing(self.model, layout=self.moe)

    def _sample(self, logits: torch.Tensor, rows: list[Request], settings: tuple[torch.Tensor, ...]) -> torch.Tensor:
        finite = None  # every row's logits are finite (one check of the whole batch, the common case)
        if not bool(torch.isfinite(logits).all()):  # broken weights fail their rows, not the whole batch
            finite = torch.isfinite(logits).all(dim=-1)
            logits = torch.where(finite.unsqueeze(1), logits, torch.zeros_like(logits))
        if self.never_generated is not None:  # a vision-language model's image tokens (miles.models.vision)
            logits = logits.index_fill(1, self.never_generated, float("-inf"))
        if self._row_sampling is None or self._row_sampling[0] is not settings:  # rows admitted or retired
            self._row_sampling = (settings, RowSampling.of(*settings))
        tokens, scaled, drawn = sample_next(logits, self._row_sampling[1], self.generator)
        reported = {"sampling": scaled, "truncated": drawn, "model": logits}[self.logprobs_of]
        # the caller holds step_lock: no update lands in this step
        take_tokens(rows, tokens.unsqueeze(1), reported.unsqueeze(1), finite, None, self.version())
        return tokens

    def _retire(self, first: int) -> None:
        """Deliver rows (from index ``first``) that finished, and drop them from the batch."""
        done = [i for i in range(first, len(self._rows)) if self._rows[i].finish is not None]
        if not done:
            return
        finished = [self._rows[i] for i in done]
        if self.prefix_cache is not None:  # the next turn's prompt starts with prompt + output
            for i, r in zip(done, finished):
                if r.epoch == self._epoch and r.finish["type"] in ("stop", "length") and len(r.output_ids) > 1:
                    try:  # the last token is not fed; a prefix not held costs a later prefill, nothing else
                        self._store(r.cache_key + r.output_ids[:-1], self._cache, i, self._mask[i])
                    except Exception:
                        _log.exception("holding the prefix of request %s failed", r.rid)
        try:
            texts = self.tokenizer.batch_decode([r.output_ids for r in finished], skip_special_tokens=True)
        except Exception:  # one request's tokens: each is decoded by itself while it is answered
            texts = [None] * len(finished)
        for r, text in zip(finished, texts):
            self._deliver(r, text)
        gone = set(done)
        self._keep([i for i in range(len(self._rows)) if i not in gone])

    def _keep(self, keep: list[int]) -> None:
        if not keep:
            self._reset()
            return
        index = torch.tensor(keep, device=self.device)
        self._rows = [self._rows[i] for i in keep]
        self._mask, self._next_pos, self._pending = self._mask[index], self._next_pos[index], self._pending[index]
        self._settings = tuple(t[index] for t in self._settings)
        lead = int((self._mask.sum(dim=0) == 0).long().cumprod(0).sum())  # columns no row attends to
        self._mask = self._mask[:, lead:]
        if self.draft is not None:
            self.draft.keep(index, lead)
        for layer in self._cache.layers:
            layer.keys, layer.values = layer.keys[index, :, lead:], layer.values[index, :, lead:]

    @torch.inference_mode()
    def _rescore(self, r: Request, meta: dict[str, Any]) -> None:
        """Replace the decode's log-probs of ``r``'s outputs with :func:`miles.models.hf.exact_logprobs` over the prompt
        and the outputs (the weights that sampled them: under the step lock; the distribution the decode reported);
        ``sampling_logprob_abs_diff_max``: how far the decode's were (float rounding of the cached decode)."""
        columns = per_position(r.params, len(r.prompt) - 1, len(r.output_ids), self.logprobs_of, self.device)
        exact = exact_logprobs(self.model, r.prompt + r.output_ids, length=self.context_length, pad_token_id=self.pad,
                               **columns)[len(r.prompt) - 1:].tolist()
        meta["sampling_logprob_abs_diff_max"] = max(abs(a - b) for a, b in zip(exact, r.output_logprobs))
        r.output_logprobs = exact

    def _answer(self, r: Request, text: str | None = None) -> dict[str, Any]:
        self.stats["requests_finished"] += 1
        meta = {}
        if r.return_logprob and self.exact_logprobs and r.output_ids:
            self._rescore(r, meta)
        if text is None:
            text = self.tokenizer.decode(r.output_ids, skip_special_tokens=True)
        return answer(r, text, self.version(), self.moe.width if self.moe is not None else None, meta)

