"""The in-process rollout engine: a ``transformers`` model on torch with continuous batching, a KV
cache, per-row sampling and per-token log-probs, answering in SGLang's ``/generate`` shape.

Requests made in the same event-loop turn are admitted together, so that a rollout function
written one sample at a time still prefills as one batch.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import torch

from miles.engine.batcher import ContinuousBatcher, Request
from miles.engine.sampling import SamplingParams
from miles.models import load_model, load_tokenizer

__all__ = ["LocalEngine"]


class LocalEngine:
    """Registered as rollout engine ``local``."""

    def __init__(self, max_batch_size: int = 1024, seed: int = 0, background: bool = False) -> None:
        self.max_batch_size = max_batch_size
        # background: a worker thread batches continuously while the caller's loop runs (servers);
        # otherwise each event-loop turn's requests are generated to completion in the calling thread.
        self.background = background
        self.seed = seed
        self.model: Any = None
        self.model_path: str | None = None
        self.tokenizer: Any = None
        self.weight_version = 0
        self.batcher: ContinuousBatcher | None = None
        self._turn: list[Request] = []
        self._outbox_lock = threading.Lock()
        self._outboxes: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future, dict[str, Any]]]] = {}

    # -- lifecycle ----------------------------------------------------------------------------------

    def load_model(self, path: str) -> None:
        self.model_path = str(path)
        self.model = load_model(path).eval()
        self.model.requires_grad_(False)
        self.tokenizer = load_tokenizer(path)
        self.context_length = int(self.model.config.max_position_embeddings)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        if self.batcher is not None:
            self.batcher.close()
        self.batcher = ContinuousBatcher(
            self.model, self.tokenizer, context_length=self.context_length, pad_token_id=pad,
            eos_token_id=self.tokenizer.eos_token_id, generator=torch.Generator().manual_seed(self.seed),
            max_batch_size=self.max_batch_size, version=lambda: self.weight_version, background=self.background,
        )

    def close(self) -> None:
        if self.batcher is not None:
            self.batcher.close()
            self.batcher = None

    def update_weights(self, state_dict: dict[str, torch.Tensor], weight_version: int | None = None) -> int:
        """Load new weights as a whole (all or nothing) between two decode steps.

        The version becomes ``weight_version`` when given (the trainer's policy version), else it is bumped.
        """
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
        with self.batcher.step_lock, torch.no_grad():
            for name, tensor in state_dict.items():
                current[name].copy_(tensor)
            self.weight_version = self.weight_version + 1 if weight_version is None else int(weight_version)
        return self.weight_version

    def rng_state(self) -> torch.Tensor:
        """The sampling generator's state (saved in checkpoints so a resumed run samples the same)."""
        return self.batcher.generator.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        with self.batcher.step_lock:
            self.batcher.generator.set_state(state)

    def abort(self, rid: str | None = None) -> int:
        return self.batcher.abort(rid)

    def pause(self) -> None:
        self.batcher.pause()

    def resume(self) -> None:
        self.batcher.resume()

    # -- generation ---------------------------------------------------------------------------------

    async def generate(
        self, input_ids: list[int], sampling_params: dict[str, Any] | None = None, return_logprob: bool = True,
        rid: str | None = None,
    ) -> dict[str, Any]:
        """One request, answered like SGLang's ``POST /generate`` (a ValueError names a bad field)."""
        params = SamplingParams.parse(sampling_params)
        if params.n != 1:
            raise ValueError("sampling_params.n: one call returns one sample; send n requests (or use the server)")
        self._check_prompt(input_ids)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        request = Request(list(input_ids), params, lambda answer: self._deliver(loop, future, answer), return_logprob)
        if rid is not None:
            request.rid = rid
        if not self._turn:
            loop.call_soon(self._submit_turn)
        self._turn.append(request)
        return await future

    def _deliver(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future, answer: dict[str, Any]) -> None:
        """Called from the batcher thread: answers wait in an outbox, one wake-up of the loop drains it."""
        if not self.background:  # generated in the loop's own thread
            if not future.done():
                future.set_result(answer)
            return
        with self._outbox_lock:
            outbox = self._outboxes.setdefault(loop, [])
            outbox.append((future, answer))
            if len(outbox) > 1:
                return
        try:
            loop.call_soon_threadsafe(self._drain, loop)
        except RuntimeError:  # the loop is closed: nobody waits for these answers any more
            with self._outbox_lock:
                self._outboxes.pop(loop, None)

    def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._outbox_lock:
            outbox = self._outboxes.pop(loop, [])
        for future, answer in outbox:
            if not future.done():
                future.set_result(answer)

    def _submit_turn(self) -> None:
        turn, self._turn = self._turn, []
        self.batcher.submit(turn)
        if not self.background:
            self.batcher.drain()

    def _check_prompt(self, input_ids: list[int]) -> None:
        if not isinstance(input_ids, list) or not input_ids:
            raise ValueError("input_ids: expected a non-empty list of token ids")
        vocab = self.model.config.vocab_size
        bad = [t for t in input_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"input_ids: token ids must be integers in [0, {vocab}), got {bad[:5]}")
        if len(input_ids) >= self.context_length:
            raise ValueError(
                f"input_ids: prompt of {len(input_ids)} tokens does not fit the context of "
                f"{self.context_length} tokens"
            )
