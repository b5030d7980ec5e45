"""SGLang's ``POST /generate`` body, checked whole and made into the embedded engine's requests before any of
them is scheduled: a batch with one bad element is refused (400 naming the element and the field) with
nothing generated."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from miles.engine.local import LocalEngine
from miles.engine.request import Request
from miles.engine.sampling import MAX_SAMPLES, shown

__all__ = ["generate_requests", "GENERATE_HONOURED", "GENERATE_IGNORED", "GENERATE_OFF_ONLY"]

# SGLang's GenerateReqInput fields (sglang 0.5) and what the embedded engine does with each.
GENERATE_HONOURED = frozenset({
    "text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "return_text_in_logprobs", "return_entropy", "return_routed_experts", "image_data",
})
GENERATE_IGNORED = frozenset({  # bookkeeping and routing hints: accepted whatever their value
    "model", "log_metrics", "no_logs", "priority", "routing_key", "conversation_id", "custom_labels",
    "external_trace_header", "received_time", "extra_key", "cache_salt", "http_worker_ipc", "routed_dp_rank",
    "data_parallel_rank", "disagg_prefill_dp_rank", "kv_hints",
})
GENERATE_OFF_ONLY = frozenset({  # features the engine lacks: accepted when null, false, 0 or empty only
    "stream", "background", "return_bytes", "return_hidden_states",
    "routed_experts_start_len", "return_indexer_topk", "return_prompt_token_ids", "token_ids_logprob",
    "return_sampling_mask", "sampling_logprobs_mode", "return_flat_raw_top_logprobs",
    "return_flat_raw_output_top_logprobs", "lora_path", "lora_id", "custom_logit_processor", "session_id",
    "session_params", "input_embeds", "video_data", "audio_data", "mm_hashes", "mm_content_hashes",
    "use_audio_in_video", "video_config", "modalities", "watermark", "positional_embed_overrides",
    "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size",
    "require_reasoning", "max_thinking_tokens", "need_wait_for_mm_inputs", "num_items_assigned", "encoder_urls",
    "max_dynamic_patch", "min_dynamic_patch", "image_max_dynamic_patch", "video_max_dynamic_patch",
    "images_config", "mm_processor_kwargs", "multi_item_delimiter_indices", "token_indices_to_pool",
})


def generate_requests(body: dict[str, Any], engine: LocalEngine) -> tuple[list[Request], bool]:
    """SGLang's ``/generate`` request as engine requests, one per sample, each checked (nothing is scheduled),
    and whether the answer is a list. A ValueError names the field, and in a batch the element."""
    unknown = sorted(set(body) - GENERATE_HONOURED - GENERATE_IGNORED - GENERATE_OFF_ONLY)
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(shown(k) for k in unknown[:10])}; expected SGLang's "
                         f"/generate fields (input_ids or text, sampling_params, return_logprob, rid, ...)")
    refused = sorted(k for k in GENERATE_OFF_ONLY & set(body) if not _off(body[k]))
    if refused:
        raise ValueError(", ".join(f"{k}: the embedded engine cannot honour {shown(body[k], as_json=True)}"
                                   for k in refused) + "; send null or false (or leave it out)")
    prompts, batched = _prompts(body, engine)

    def each(name: str, default: Any) -> list[Any]:  # in a batch, a list holds one value per prompt
        value = body.get(name)
        if batched and isinstance(value, list):
            if len(value) != len(prompts):
                raise ValueError(f"{name}: expected one entry per prompt ({len(prompts)}), got {len(value)}")
            return [default if v is None else v for v in value]
        if name == "rid" and batched and value is not None:
            raise ValueError("rid: a batch needs a list of rids, one per prompt")
        return [default if value is None else value] * len(prompts)

    params = each("sampling_params", {})
    counts = [_element(batched, i, _samples_per_prompt, p) for i, p in enumerate(params)]
    if sum(counts) > MAX_SAMPLES:
        raise ValueError(f"sampling_params.n: this request asks for {sum(counts)} samples (prompts x n); one request "
                         f"generates at most {MAX_SAMPLES}: send the rest in another")
    shared = {"return_entropy": _flag(body, "return_entropy"),
              "return_text_in_logprobs": _flag(body, "return_text_in_logprobs")}
    per_prompt = zip(prompts, params, counts, each("rid", None), each("return_logprob", False),
                     each("logprob_start_len", -1), each("top_logprobs_num", 0), each("return_routed_experts", False),
                     each("image_data", None))
    requests = []
    for index, (prompt, sampling, n, rid, return_logprob, start, top, routed, images) in enumerate(per_prompt):
        job = {"input_ids": prompt, "sampling_params": {k: v for k, v in sampling.items() if k != "n"},
               "rid": None if n > 1 else rid, "return_logprob": return_logprob, "logprob_start_len": start,
               "top_logprobs_num": top, "return_routed_experts": routed, "image_data": images, **shared}
        requests += [_element(batched, index, engine.prepare, **job) for _ in range(n)]  # prompt-major
    return requests, batched or len(requests) > len(prompts)


def _element(batched: bool, index: int, check: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``check(*args, **kwargs)``, its ValueError naming element ``index`` of a batch."""
    try:
        return check(*args, **kwargs)
    except ValueError as exc:
        raise ValueError(f"batch element {index}: {exc}" if batched else str(exc)) from exc


def _off(value: Any) -> bool:
    """Whether ``value`` leaves a feature off: null, false, 0 or empty."""
    return value is None or value is False or (type(value) in (int, float) and value == 0) or (
        isinstance(value, (str, list, dict)) and not value)


def _flag(body: dict[str, Any], name: str) -> Any:
    """A field that is true or false, null meaning false (a wrong type is left for the engine to name)."""
    value = body.get(name)
    return False if value is None else value


def _prompts(body: dict[str, Any], engine: LocalEngine) -> tuple[list[Any], bool]:
    """The prompts (token ids; text is tokenized) and whether the request is a batch."""
    if (body.get("text") is None) == (body.get("input_ids") is None):
        raise ValueError("input_ids, text: send exactly one of them (token ids, or text to tokenize)")
    if body.get("text") is not None:
        text = body["text"]
        if not isinstance(text, list):
            return [engine.tokenize(text)], False
        if not text:
            raise ValueError("text: expected a string, or a non-empty list of strings")
        return [_element(True, index, engine.tokenize, one) for index, one in enumerate(text)], True
    input_ids = body["input_ids"]
    if not isinstance(input_ids, list) or not input_ids:
        raise ValueError(f"input_ids: expected a non-empty list of token ids, or a list of such lists, "
                         f"got {shown(input_ids)}")
    if any(isinstance(x, list) for x in input_ids):
        if not all(isinstance(x, list) for x in input_ids):
            raise ValueError("input_ids: expected a list of token ids, or a list of such lists, not a mix")
        return input_ids, True
    return [input_ids], False


def _samples_per_prompt(params: Any) -> int:
    """SGLang's ``n`` of a prompt's ``sampling_params``: the server turns it into n requests."""
    if not isinstance(params, dict):
        raise ValueError(f"sampling_params: expected a JSON object (in a batch, or a list of one per prompt), "
                         f"got {shown(params)}")
    n = params.get("n", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SAMPLES:
        raise ValueError(f"sampling_params.n: expected an integer in [1, {MAX_SAMPLES}], got {shown(n)}")
    return n
