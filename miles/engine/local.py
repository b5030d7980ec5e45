"""The in-process rollout engine: a ``transformers`` model on torch with a KV cache, batched
sampling and per-token log-probs, answering in SGLang's ``/generate`` shape.

Concurrent ``generate`` calls made in the same event-loop turn are served as one batch, so that a
rollout function written one sample at a time still runs batched.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from miles.engine.sampling import SamplingParams, sample_next
from miles.models import load_model, load_tokenizer

__all__ = ["LocalEngine"]


@dataclass
class _Pending:
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    future: asyncio.Future


class LocalEngine:
    """Registered as rollout engine ``local``."""

    def __init__(self, max_batch_size: int = 1024, seed: int = 0, threaded: bool = False) -> None:
        self.max_batch_size = max_batch_size
        self.threaded = threaded  # generate in a worker thread, keeping the event loop free (servers)
        self.seed = seed
        self.model: Any = None
        self.model_path: str | None = None
        self.tokenizer: Any = None
        self.weight_version = 0
        self._generator = torch.Generator().manual_seed(seed)
        self._pending: list[_Pending] = []
        self._flush_scheduled = False
        self._flush_task: asyncio.Task | None = None  # held so the running flush is not garbage-collected

    # -- lifecycle ----------------------------------------------------------------------------------

    def load_model(self, path: str) -> None:
        self.model_path = str(path)
        self.model = load_model(path).eval()
        self.model.requires_grad_(False)
        self.tokenizer = load_tokenizer(path)
        self.context_length = int(self.model.config.max_position_embeddings)
        self.eos_token_id = self.tokenizer.eos_token_id
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> int:
        """Load new weights as a whole (all or nothing) and bump the weight version."""
        current = self.model.state_dict()
        problems = [n for n in state_dict if n not in current]
        problems += [f"{n} (missing)" for n in current if n not in state_dict]
        problems += [
            f"{n} (shape {tuple(t.shape)}, expected {tuple(current[n].shape)})"
            for n, t in state_dict.items()
            if n in current and t.shape != current[n].shape
        ]
        if problems:
            raise ValueError(f"weight update refused, mismatched parameters: {', '.join(problems[:8])}")
        with torch.no_grad():
            for name, tensor in state_dict.items():
                current[name].copy_(tensor)
        self.weight_version += 1
        return self.weight_version

    # -- generation ---------------------------------------------------------------------------------

    async def generate(
        self, input_ids: list[int], sampling_params: dict[str, Any] | None = None, return_logprob: bool = True
    ) -> dict[str, Any]:
        """One request, answered like SGLang's ``POST /generate`` (a ValueError names a bad field)."""
        params = SamplingParams.parse(sampling_params)
        self._check_prompt(input_ids)
        loop = asyncio.get_running_loop()
        pending = _Pending(list(input_ids), params, return_logprob, loop.create_future())
        self._pending.append(pending)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            if self.threaded:
                self._flush_task = loop.create_task(self._flush_in_thread())
            else:
                loop.call_soon(self._flush)
        return await pending.future

    def _check_prompt(self, input_ids: list[int]) -> None:
        if not input_ids:
            raise ValueError("input_ids: expected a non-empty list of token ids")
        vocab = self.model.config.vocab_size
        bad = [t for t in input_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"input_ids: token ids must be integers in [0, {vocab}), got {bad[:5]}")
        if len(input_ids) >= self.context_length:
            raise ValueError(
                f"input_ids: prompt of {len(input_ids)} tokens does not fit the context of "
                f"{self.context_length} tokens"
            )

    def _take_chunks(self) -> list[list[_Pending]]:
        self._flush_scheduled = False
        pending, self._pending = self._pending, []
        return [pending[i : i + self.max_batch_size] for i in range(0, len(pending), self.max_batch_size)]

    def _run_chunk(self, chunk: list[_Pending]) -> list[dict[str, Any]] | Exception:
        try:
            return self.generate_batch([p.input_ids for p in chunk], [p.params for p in chunk])
        except Exception as exc:  # the requests fail; the engine keeps serving
            return exc

    @staticmethod
    def _resolve(chunk: list[_Pending], answers: list[dict[str, Any]] | Exception) -> None:
        for i, p in enumerate(chunk):
            if p.future.done():
                continue
            if isinstance(answers, Exception):
                p.future.set_exception(answers)
                continue
            if not p.return_logprob:
                answers[i]["meta_info"].pop("output_token_logprobs")
            p.future.set_result(answers[i])

    def _flush(self) -> None:
        for chunk in self._take_chunks():
            self._resolve(chunk, self._run_chunk(chunk))

    async def _flush_in_thread(self) -> None:
        await asyncio.sleep(0)  # let the requests of this turn join the batch
        loop = asyncio.get_running_loop()
        for chunk in self._take_chunks():
            self._resolve(chunk, await loop.run_in_executor(None, self._run_chunk, chunk))

    @torch.inference_mode()
    def generate_batch(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[dict[str, Any]]:
        """Generate for a static batch of prompts (left-padded, KV-cached decoding)."""
        batch = len(prompts)
        width = max(len(p) for p in prompts)
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt) :] = 1
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)

        budget = torch.tensor([min(p.max_new_tokens, self.context_length - len(x)) for p, x in zip(params, prompts)])
        temperature = torch.tensor([float(p.temperature) for p in params])
        top_p = torch.tensor([float(p.top_p) for p in params])
        top_k = torch.tensor([p.top_k for p in params])
        stop_ids = [list(p.stop_token_ids) + ([] if p.ignore_eos else [self.eos_token_id]) for p in params]
        width_stop = max(1, max(len(s) for s in stop_ids))
        stop_table = torch.tensor([s + [-1] * (width_stop - len(s)) for s in stop_ids])  # [B, S]

        out_tokens: list[torch.Tensor] = []
        out_logprobs: list[torch.Tensor] = []
        done = budget <= 0
        lengths = torch.zeros(batch, dtype=torch.long)
        matched = torch.full((batch,), -1, dtype=torch.long)
        cache = DynamicCache()
        steps = int(budget.max().item()) if batch else 0
        if steps > 0:
            logits = self.model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                cache=cache, use_cache=True, logits_to_keep=1,
            ).logits[:, -1, :].float()
        for step in range(steps):
            logprobs = torch.log_softmax(logits, dim=-1)
            tokens = sample_next(logits, temperature, top_p, top_k, self._generator)
            tokens = torch.where(done, self.pad_token_id, tokens)
            out_tokens.append(tokens)
            out_logprobs.append(logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1))
            active = ~done
            lengths += active.long()
            hit_stop = (tokens.unsqueeze(1) == stop_table).any(dim=1) & active
            matched = torch.where(hit_stop, tokens, matched)
            done = done | hit_stop | (lengths >= budget)
            if bool(done.all()):
                break
            attention_mask = torch.cat([attention_mask, torch.ones((batch, 1), dtype=torch.long)], dim=1)
            position_ids = position_ids[:, -1:] + 1
            logits = self.model(
                input_ids=tokens.unsqueeze(1), attention_mask=attention_mask, position_ids=position_ids,
                cache=cache, use_cache=True,
            ).logits[:, -1, :].float()

        tokens_all = torch.stack(out_tokens, dim=1).tolist() if out_tokens else [[] for _ in prompts]
        logprobs_all = torch.stack(out_logprobs, dim=1).tolist() if out_logprobs else [[] for _ in prompts]
        lengths_list, matched_list = lengths.tolist(), matched.tolist()
        output_ids = [row[:n] for row, n in zip(tokens_all, lengths_list)]
        texts = self.tokenizer.batch_decode(output_ids, skip_special_tokens=True)
        answers = []
        for row in range(batch):
            n = lengths_list[row]
            if matched_list[row] >= 0:
                finish = {"type": "stop", "matched": matched_list[row]}
            else:
                finish = {"type": "length", "length": n}
            answers.append(
                {
                    "text": texts[row],
                    "output_ids": output_ids[row],
                    "meta_info": {
                        "prompt_tokens": len(prompts[row]),
                        "completion_tokens": n,
                        "finish_reason": finish,
                        "output_token_logprobs": [
                            [lp, tok, None] for lp, tok in zip(logprobs_all[row][:n], output_ids[row])
                        ],
                        "weight_version": self.weight_version,
                    },
                }
            )
        return answers
