"""The in-process rollout engine: a ``transformers`` model on torch with continuous batching, a KV
cache, per-row sampling and per-token log-probs, answering in SGLang's ``/generate`` shape.

Requests made in the same event-loop turn are admitted together, so that a rollout function
written one sample at a time still prefills as one batch. A prefix cache of ``prefix_cache_tokens``
tokens (0: off) lets a prompt that starts with tokens seen before (the n samples of a prompt, the
next turn of a trajectory) skip their prefill; weight updates, a new model and ``flush_cache`` empty it.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable
from typing import Any

from miles.engine.image_input import ImageCache, attach_images
from miles.engine import speculative as speculative_config
from miles.engine import weight_checks
from miles.engine.request import Request
from miles.engine.sampling import SamplingParams, shown
from miles.lazy import lazy_module
from miles.models.sampling import LOGPROBS_OF
from miles.models.vision import vision_spec
from miles.precision import schemes
from miles.weights.delta import DeltaRefused, raw_bytes
from miles.weights.lora import adapter_layers, adapter_problems, is_adapter_payload, merged_weight

torch = lazy_module("torch")
linear = lazy_module("miles.precision.linear")  # its layers subclass torch's: imported when a scheme is used
# imported when first used: `miles config` reads LocalEngine's arguments without torch or transformers
batcher = lazy_module("miles.engine.batcher")
drafts = lazy_module("miles.engine.draft")
hf = lazy_module("miles.models.hf")

__all__ = ["LocalEngine", "MEMORY_TAGS"]

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # SGLang's names; the CPU engine has no CUDA graphs (no-op)


class LocalEngine:
    """Registered as rollout engine ``local``."""

    # Takes LoRA adapter payloads (miles.weights.lora) in update_weights and merges them into its base weights
    accepts_lora_adapters = True
    logprobs_of_choices = LOGPROBS_OF  # every distribution of miles.models.sampling
    accepts_precision = True  # rollout.precision: the decoder's linear layers in a scheme's stored form

    def __init__(self, max_batch_size: int = 1024, seed: int = 0, background: bool = False,
                 prefix_cache_tokens: int = 32768, device: str = "cpu", dtype: str = "float32",
                 exact_logprobs: bool = False, logprobs_of: str = "sampling",
                 precision: dict[str, Any] | None = None, speculative: dict[str, Any] | None = None) -> None:
        """``device``: cpu, cuda (one GPU) or auto (cuda when torch sees one); ``dtype``: the weights' type (float32,
        bfloat16 or float16; auto: bfloat16 on a GPU that supports it, else float32). ``exact_logprobs``: log-probs as
        the trainer computes them, bit for bit (``rollout.true_on_policy``); ``logprobs_of``: their distribution.
        ``precision``: a precision scheme's spec (``rollout.precision``; :meth:`miles.precision.schemes.Scheme.spec`):
        the engine holds its linear layers in the scheme's stored form and computes as the scheme says.
        ``speculative``: a draft model proposes tokens that the model verifies (:mod:`miles.engine.speculative`)."""
        if not isinstance(exact_logprobs, bool):
            raise ValueError(f"exact_logprobs: expected true or false, got {exact_logprobs!r}")
        if logprobs_of not in LOGPROBS_OF:
            raise ValueError(f"logprobs_of: expected one of {', '.join(LOGPROBS_OF)}, got {logprobs_of!r}")
        self.exact_logprobs, self.logprobs_of = exact_logprobs, logprobs_of
        self.scheme = schemes.from_spec(precision) if precision is not None else None
        self.speculative = speculative_config.SpeculativeConfig.parse(speculative) if speculative is not None else None
        self.draft: Any = None  # the draft model (speculative)
        self.speculating = False  # whether decode steps speculate (the draft can pay, or speculative.force)
        if not _is_int(prefix_cache_tokens) or prefix_cache_tokens < 0:
            raise ValueError(f"prefix_cache_tokens: expected an integer >= 0 (0: no prefix cache), "
                             f"got {prefix_cache_tokens!r}")
        if device not in ("cpu", "cuda", "auto"):
            raise ValueError(f"device: expected cpu, cuda or auto, got {device!r}")
        if dtype not in ("float32", "bfloat16", "float16", "auto"):
            raise ValueError(f"dtype: expected float32, bfloat16, float16 or auto, got {dtype!r}")
        self.device, self.dtype, self.max_batch_size = device, dtype, max_batch_size
        self.prefix_cache_tokens, self.seed = prefix_cache_tokens, seed
        # background: a worker thread batches continuously while the caller's loop runs (servers);
        # otherwise each event-loop turn's requests are generated to completion in the calling thread.
        self.background = background
        self.model: Any = None
        self.model_path: str | None = None
        self.tokenizer: Any = None
        self.weight_version = 0
        self.instance = uuid.uuid4().hex[:16]  # this engine, as its server reports it (a restart makes another)
        self.released: set[str] = set()  # memory given back (release_memory): "weights", "kv_cache"
        self.weights_stale = False  # weights resumed after a release hold nothing until an update
        self._released_shapes: list[tuple[torch.nn.Parameter, torch.Size]] = []
        # base weights of the layers an adapter payload has been merged into (copied before the first merge)
        self._lora_base: dict[str, torch.Tensor] = {}
        self.batcher: batcher.ContinuousBatcher | None = None
        self._turn: list[Request] = []
        self.cancelled = 0  # requests whose caller went away before their answer (each aborted in the batcher)
        self._outbox_lock = threading.Lock()
        self._outboxes: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future, dict[str, Any]]]] = {}

    # -- lifecycle ----------------------------------------------------------------------------------

    def load_model(self, path: str) -> None:
        self.model_path = str(path)
        device = torch.device("cuda" if self.device == "cuda" or (self.device == "auto" and torch.cuda.is_available())
                              else "cpu")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device is 'cuda' but torch sees no GPU")
        dtype = self.dtype
        if dtype == "auto":
            dtype = "bfloat16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "float32"
        self.model = hf.load_model(path, dtype=getattr(torch, dtype)).to(device).eval()
        self.quantized_layers: list[str] = []
        if self.scheme is not None:
            names = linear.target_modules(self.model, self.scheme.include, self.scheme.exclude)
            if problems := linear.shape_problems(self.model, self.scheme, names):
                raise ValueError(f"precision {self.scheme.name}: {len(problems)} layer(s) it cannot take: "
                                 f"{'; '.join(problems)} (exclude them: rollout.precision.exclude)")
            linear.quantize_model(self.model, self.scheme, names)
            self.quantized_layers = names
        self._lora_base = {}
        self.model.requires_grad_(False)
        self.tokenizer = hf.load_tokenizer(path)
        text = self.model.config.get_text_config()
        self.context_length, self.vocab_size = int(text.max_position_embeddings), int(text.vocab_size)
        self.vision = vision_spec(self.model.config)  # None: a text-only model
        self.image_processor = hf.load_image_processor(path) if self.vision is not None else None
        if self.vision is not None and self.image_processor is None:
            raise ValueError(f"{path}: a vision-language model needs its image processor "
                             f"(preprocessor_config.json) in the model directory")
        self.image_cache = ImageCache(self.image_processor) if self.image_processor is not None else None
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        if self.speculative is not None:
            self.draft, self.speculating = drafts.load_draft(self.speculative, self.model, self.model_path,
                                                             self.tokenizer, self.seed, device)
        if self.batcher is not None:
            self.batcher.close()
        self.batcher = batcher.ContinuousBatcher(
            self.model, self.tokenizer, context_length=self.context_length, pad_token_id=pad,
            eos_token_id=self.tokenizer.eos_token_id, generator=torch.Generator(device).manual_seed(self.seed),
            max_batch_size=self.max_batch_size, version=lambda: self.weight_version, background=self.background,
            prefix_cache_tokens=self.prefix_cache_tokens, exact_logprobs=self.exact_logprobs,
            logprobs_of=self.logprobs_of, speculative=self.speculative if self.speculating else None,
            draft=self.draft,
        )
        if self.vision is not None:
            self.batcher.never_generated = torch.tensor(self.vision.never_generated, device=device)

    def close(self) -> None:
        if self.batcher is not None:
            self.batcher.close()
            self.batcher = None

    def update_weights(self, state_dict: dict[str, torch.Tensor], weight_version: int | None = None,
                       allow_non_finite: bool = False) -> int:
        """Load new weights as a whole (all or nothing) between two decode steps.

        Every parameter must be present with its shape; a floating-point tensor loads into a floating-point
        parameter of any precision (cast, e.g. bf16 into fp32), any other dtype must match exactly. NaN/inf
        values are refused unless ``allow_non_finite``. A ValueError names every offending tensor and nothing
        is applied. The version becomes ``weight_version`` when given (the trainer's policy version), else it
        is bumped. Tensors named ``draft.*`` are the speculative draft's (all of its weights; they leave the
        version as it is).
        """
        if "weights" in self.released:
            raise ValueError("the engine's weights are released (release_memory_occupation); resume them "
                             "(resume_memory_occupation) before an update")
        prefix = speculative_config.DRAFT_PREFIX
        if any(name.startswith(prefix) for name in state_dict):  # the draft's weights, pushed with the policy's
            draft = {name[len(prefix):]: t for name, t in state_dict.items() if name.startswith(prefix)}
            state_dict = {name: t for name, t in state_dict.items() if not name.startswith(prefix)}
            drafts.check_draft_weights(self.draft, draft, allow_non_finite)
            version = self._update_target(state_dict, weight_version, allow_non_finite) if state_dict \
                else self.weight_version
            with self.batcher.step_lock:  # once the policy's part has loaded (or raised: nothing applied)
                drafts.load_draft_weights(self.draft, draft, self.batcher.draft)
            return version
        return self._update_target(state_dict, weight_version, allow_non_finite)

    def _update_target(self, state_dict: dict[str, torch.Tensor], weight_version: int | None,
                       allow_non_finite: bool) -> int:
        current = self.model.state_dict()
        if is_adapter_payload(state_dict):
            return self._update_adapters(current, state_dict, weight_version, allow_non_finite)
        problems = weight_checks.weight_problems(current, state_dict, allow_non_finite)
        if problems:
            raise ValueError(f"weight update refused, nothing was applied (the old weights keep serving): "
                             f"{'; '.join(problems)}")
        with self.batcher.step_lock, torch.no_grad():
            for name, tensor in state_dict.items():
                current[name].copy_(tensor)
            self._lora_base = {}  # full weights are the new base
            self.batcher.clear_prefix_cache()  # K/V of the old weights
            self.weight_version = self.weight_version + 1 if weight_version is None else int(weight_version)
            self.weights_stale = False
        return self.weight_version

    def update_weight_blocks(self, blocks: list[tuple[str, int, torch.Tensor]], weight_version: int,
                             check: Callable[[dict[str, torch.Tensor], int], None],
                             allow_non_finite: bool = False) -> int:
        """A delta push (:mod:`miles.weights.delta`): copy each block ``(name, first byte, bytes)`` into that
        parameter's bytes, as a whole or not at all. ``check(parameters, version)`` runs first under the step
        lock (no other update in between) and raises to apply nothing."""
        if "weights" in self.released or self.weights_stale:
            raise DeltaRefused("the engine's weights were released; it needs the whole weights")
        current = self.model.state_dict()
        if bad := [name for name, _, _ in blocks if name not in current]:
            raise DeltaRefused(f"the model has no {bad[0]}")
        if not allow_non_finite:
            non_finite = sorted({name for name, _, values in blocks if current[name].dtype.is_floating_point
                                 and not weight_checks.finite(weight_checks.typed(values, current[name].dtype))})
            if non_finite:
                raise ValueError(f"weight update refused, nothing was applied (the old weights keep serving): "
                                 f"{len(non_finite)} with NaN or inf values: {weight_checks.names(non_finite)} "
                                 f"(send allow_non_finite: true to load them anyway)")
        with self.batcher.step_lock, torch.no_grad():
            check(current, self.weight_version)
            for name, start, values in blocks:
                raw_bytes(current[name])[start:start + values.numel()].copy_(values)
            self._lora_base = {}  # the whole weights are the trainer's: the new base
            self.batcher.clear_prefix_cache()  # K/V of the old weights
            self.weight_version = int(weight_version)
        return self.weight_version

    def _update_adapters(self, current: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor],
                         weight_version: int | None, allow_non_finite: bool) -> int:
        """An adapter payload: every adapted layer becomes its base weight + ``scaling * B @ A``; a layer adapted
        before and not in this payload goes back to its base weight. The base is what the engine held before its
        first adapter update (the loaded model, or the last full update)."""
        if self.weights_stale:
            raise ValueError("weight update refused: an adapter update merges into the base weights, which the "
                             "engine gave back (release_memory_occupation); push full weights first")
        base = {name: self._lora_base.get(name, current.get(name)) for name in current}
        problems = adapter_problems({k: v for k, v in base.items() if v is not None}, adapters, allow_non_finite)
        if problems:
            raise ValueError(f"adapter update refused, nothing was applied (the old weights keep serving): "
                             f"{'; '.join(problems)}")
        layers = [layer + ".weight" for layer in adapter_layers(adapters)]
        with self.batcher.step_lock, torch.no_grad():
            for name in layers:
                if name not in self._lora_base:
                    self._lora_base[name] = current[name].detach().clone()
            for name, weight in self._lora_base.items():
                if name in layers:
                    layer = name[: -len(".weight")]
                    merged_weight(weight, adapters[layer + ".lora_A.weight"], adapters[layer + ".lora_B.weight"],
                                  adapters[layer + ".lora_scaling"], out=current[name])
                else:
                    current[name].copy_(weight)
            self.batcher.clear_prefix_cache()  # K/V of the old weights
            self.weight_version = self.weight_version + 1 if weight_version is None else int(weight_version)
        return self.weight_version

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Give back memory while a colocated trainer trains (SGLang's ``release_memory_occupation``): ``weights``
        (the parameters' storage) and ``kv_cache`` (the prefix cache); None or [] means both. Only when idle."""
        tags = self._memory_tags(tags)
        with self.batcher.step_lock, torch.no_grad():
            # under the step lock: a request already answered has left the batch (rows retire in the same step)
            load = self.batcher.load()
            if load["running_requests"] or load["waiting_requests"] or self._turn:
                raise ValueError(f"the engine is busy ({load['running_requests']} running, "
                                 f"{load['waiting_requests']} waiting); release memory only when it is idle")
            if "kv_cache" in tags:
                self.batcher.clear_prefix_cache()
            if "weights" in tags and "weights" not in self.released:
                # tied parameters are one object: released once; the shapes come back with resume_memory
                self._released_shapes = [(param, param.shape) for param in self.model.parameters()]
                self._lora_base = {}  # given back too: after a resume, full weights come first
                for param, _ in self._released_shapes:
                    param.data = torch.empty(0, dtype=param.dtype, device=param.device)
            self.released |= tags

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Take the memory back (SGLang's ``resume_memory_occupation``). As in SGLang without a CPU backup of the
        weights, resumed weights hold nothing: the engine refuses to generate until weights are pushed again."""
        tags = self._memory_tags(tags)
        if not_released := sorted(tags - self.released):
            raise ValueError(f"tags: {', '.join(not_released)} not released")
        with self.batcher.step_lock, torch.no_grad():
            if "weights" in tags:
                for param, shape in self._released_shapes:
                    param.data = torch.zeros(shape, dtype=param.dtype, device=param.device)
                self._released_shapes = []
                self.weights_stale = True
            self.released -= tags

    def refusal(self) -> str | None:
        """Why the engine cannot generate now (memory released, weights not pushed since), else None."""
        if self.released:
            return (f"the engine's memory is released ({', '.join(sorted(self.released))}: "
                    f"release_memory_occupation); resume_memory_occupation first")
        if self.weights_stale:
            return "the engine's weights were released and resumed but not updated since; push weights first"
        return None

    @staticmethod
    def _memory_tags(tags: list[str] | None) -> set[str]:
        if tags is None or tags == []:
            return set(MEMORY_TAGS)
        if not isinstance(tags, list) or any(t not in MEMORY_TAGS for t in tags):
            raise ValueError(f"tags: expected a list of {', '.join(MEMORY_TAGS)} (or null for all), got {shown(tags)}")
        return set(tags)

    def rng_state(self) -> torch.Tensor:
        """The sampling generator's state (saved in checkpoints so a resumed run samples the same)."""
        return self.batcher.generator.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        with self.batcher.step_lock:
            self.batcher.generator.set_state(state)

    def abort(self, rid: str | None = None) -> int:
        return self.batcher.abort(rid)

    def flush_cache(self) -> None:
        """Empty the prefix cache (between two decode steps; running requests go on)."""
        with self.batcher.step_lock:
            self.batcher.clear_prefix_cache()

    def stats(self) -> dict[str, int]:
        """Counters (requests finished, aborted, failed and cancelled by their caller, prefill batches, decode
        steps, prompt tokens admitted and actually prefilled), the tokens the prefix cache holds, and the current
        load."""
        load = self.batcher.load()
        return {**self.batcher.stats, **load, "waiting_requests": load["waiting_requests"] + len(self._turn),
                "requests_cancelled": self.cancelled, "weight_bytes": linear.weight_bytes(self.model)}

    def tokenize(self, text: str) -> list[int]:
        """``text`` as the model's tokenizer encodes it (with its special tokens, as SGLang does)."""
        if not isinstance(text, str) or not text:
            raise ValueError(f"text: expected a non-empty string, got {shown(text)}")
        try:
            return list(self.tokenizer.encode(text))
        except Exception as exc:  # text Python holds but UTF-8 cannot (a lone surrogate from a JSON escape)
            raise ValueError(f"text: the tokenizer cannot encode it ({type(exc).__name__}: {exc})") from exc

    def pause(self) -> None:
        self.batcher.pause()

    def resume(self) -> None:
        self.batcher.resume()

    # -- generation ---------------------------------------------------------------------------------

    async def generate(
        self, input_ids: list[int], sampling_params: dict[str, Any] | None = None, return_logprob: bool = True,
        rid: str | None = None, *, logprob_start_len: int = -1, top_logprobs_num: int = 0,
        return_entropy: bool = False, return_text_in_logprobs: bool = False, return_routed_experts: bool = False,
        image_data: Any = None,
    ) -> dict[str, Any]:
        """One request, answered like SGLang's ``POST /generate`` (a ValueError names a bad field).

        With ``return_logprob``: ``logprob_start_len >= 0`` adds ``input_token_logprobs`` (the prompt's, from
        that position; the first token has none), ``top_logprobs_num`` adds ``output_top_logprobs`` (and
        ``input_top_logprobs``), ``return_text_in_logprobs`` fills each triple's text. ``return_entropy`` adds
        ``output_token_entropy`` (nats). Output log-probs are of the distribution ``logprobs_of`` names (at the
        request's temperature by default), the prompt's of the model's own.
        ``return_routed_experts`` (MoE models) adds ``routed_experts``: SGLang's base64 of int32 expert ids
        ``[tokens, num_layers, top_k]`` of every token fed through the model (the prompt, then the outputs but the
        last; -1 for dense layers); such a request's prompt is computed whole, not from the prefix cache.
        ``image_data`` (vision-language models): the prompt's images, one per image span
        (:mod:`miles.engine.image_input`). Cancelling the call aborts the request (see :meth:`run`).
        """
        return await self.run(self.prepare(
            input_ids, sampling_params, return_logprob, rid, logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num, return_entropy=return_entropy,
            return_text_in_logprobs=return_text_in_logprobs, return_routed_experts=return_routed_experts,
            image_data=image_data))

    def prepare(
        self, input_ids: list[int], sampling_params: dict[str, Any] | None = None, return_logprob: bool = True,
        rid: str | None = None, *, logprob_start_len: int = -1, top_logprobs_num: int = 0,
        return_entropy: bool = False, return_text_in_logprobs: bool = False, return_routed_experts: bool = False,
        image_data: Any = None,
    ) -> Request:
        """The request :meth:`generate` would make, checked but not scheduled: a batch is checked whole before
        any of it runs. A ValueError names the bad field; EngineUnavailable says why nothing can run now."""
        if (why := self.refusal()) is not None:
            raise EngineUnavailable(why)
        params = SamplingParams.parse(sampling_params)
        if params.n != 1:
            raise ValueError("sampling_params.n: one call returns one sample; send n requests (or use the server)")
        self._check_prompt(input_ids)
        request = Request(list(input_ids), params, _unscheduled)
        attach_images(request, image_data, self.vision, self.image_cache)  # may widen the prompt
        if request.images and self.exact_logprobs:
            raise ValueError("image_data: exact log-probs (rollout.true_on_policy) cover text-only prompts")
        if len(request.prompt) >= self.context_length:
            raise ValueError(f"input_ids: prompt of {len(request.prompt)} tokens (images widened) does not fit "
                             f"the context of {self.context_length} tokens")
        vocab, start, top = self.vocab_size, logprob_start_len, top_logprobs_num
        input_ids = request.prompt
        checks = [
            ("rid", rid, rid is None or isinstance(rid, str), "a string"),
            ("return_logprob", return_logprob, isinstance(return_logprob, bool), "true or false"),
            ("logprob_start_len", start, _is_int(start) and -1 <= start < len(input_ids),
             f"-1 (no prompt log-probs) or a prompt position in [0, {len(input_ids)})"),
            ("top_logprobs_num", top, _is_int(top) and 0 <= top <= vocab, f"an integer in [0, {vocab}]"),
            ("return_entropy", return_entropy, isinstance(return_entropy, bool), "true or false"),
            ("return_text_in_logprobs", return_text_in_logprobs, isinstance(return_text_in_logprobs, bool),
             "true or false"),
            ("return_routed_experts", return_routed_experts, isinstance(return_routed_experts, bool)
             and not (return_routed_experts and self.batcher.moe is None),
             "true or false (true only for a mixture-of-experts model; this one has no expert router)"),
        ]
        for name, value, ok, expected in checks:
            if not ok:
                raise ValueError(f"{name}: expected {expected}, got {shown(value)}")
        request.return_logprob, request.logprob_start_len, request.top_logprobs_num = return_logprob, start, top
        request.return_entropy, request.return_routed_experts = return_entropy, return_routed_experts
        request.return_text_in_logprobs = return_text_in_logprobs
        if rid is not None:
            request.rid = rid
        return request

    async def run(self, request: Request) -> dict[str, Any]:
        """Generate a :meth:`prepare`d request with the others of this event-loop turn. Cancelled (its caller went
        away: a client that disconnected from the server), it is aborted: queued, it never runs; running, its row
        leaves the batch at the next step."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        request.deliver = lambda answer: self._deliver(loop, future, answer)
        if not self._turn:
            loop.call_soon(self._submit_turn)
        self._turn.append(request)
        try:
            answer = await future
        except asyncio.CancelledError:
            self.batcher.cancel(request)
            self.cancelled += 1  # after: whoever reads the count finds the request marked
            raise
        if request.return_text_in_logprobs:
            self._fill_logprob_texts(answer["meta_info"])
        return answer

    def _fill_logprob_texts(self, meta: dict[str, Any]) -> None:
        """Put each token's text in the third place of the [logprob, token_id, text] triples."""
        triples = [t for key in ("output_token_logprobs", "input_token_logprobs") for t in meta.get(key, [])]
        triples += [t for key in ("output_top_logprobs", "input_top_logprobs")
                    for position in meta.get(key, []) if position for t in position]
        texts = self.tokenizer.batch_decode([[t[1]] for t in triples])
        for triple, text in zip(triples, texts):
            triple[2] = text

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
        vocab = self.vocab_size
        bad = [t for t in input_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"input_ids: token ids must be integers in [0, {vocab}), got {shown(bad[:5])}")
        if len(input_ids) >= self.context_length:
            raise ValueError(
                f"input_ids: prompt of {len(input_ids)} tokens does not fit the context of "
                f"{self.context_length} tokens"
            )


def _unscheduled(answer: dict[str, Any]) -> None:
    raise RuntimeError("a prepared request is answered only once LocalEngine.run schedules it")


class EngineUnavailable(RuntimeError):
    """The engine cannot generate now (its memory is released); served as HTTP 503."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
