"""A request to the embedded engine as the batcher holds it, and its answer in the shape of SGLang's
``POST /generate``."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from miles.engine.sampling import SamplingParams
from miles.lazy import lazy_module
from miles.models.moe import encode_routed_experts

torch = lazy_module("torch")

__all__ = ["Request", "answer", "plain_answer", "clear_outputs"]

_ids = itertools.count()


@dataclass(eq=False)
class Request:
    prompt: list[int]
    params: SamplingParams
    deliver: Callable[[dict[str, Any]], None]  # called from the worker thread with the answer
    return_logprob: bool = True
    rid: str = field(default_factory=lambda: f"req-{next(_ids)}")
    # SGLang's extra log-prob outputs (with return_logprob): prompt log-probs from this position (-1: none),
    # the top-k alternatives at each position, and (on its own) the entropy of each next-token distribution
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_entropy: bool = False
    return_routed_experts: bool = False  # MoE models: the expert ids of every token fed (prompt, outputs but the last)
    return_text_in_logprobs: bool = False  # read by the engine that answers, not by the batcher
    budget: int = 0
    stop_ids: frozenset[int] = frozenset()
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[list[tuple[float, int]]] = field(default_factory=list)
    output_entropy: list[float] = field(default_factory=list)
    routed: list[torch.Tensor] = field(default_factory=list)  # [tokens, num_layers * top_k] per forward pass
    output_versions: list[int] = field(default_factory=list)  # the weight version that sampled each output token
    input_logprobs: list[float | None] = field(default_factory=list)  # from logprob_start_len; None: first token
    input_top: list[list[tuple[float, int]] | None] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    aborted: bool = False
    epoch: int = 0  # the prefix cache's epoch at admission: K/V from older weights are never stored
    # a vision-language model's prompt (miles.engine.image_input): its images in order, the [start, end) of each
    # one's tokens, multimodal positions [3, len(prompt)] and the offset of generated tokens' positions, and the
    # ids the prefix cache holds it under (the image tokens replaced by numbers drawn from the images)
    images: list[Any] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)
    positions: torch.Tensor | None = None
    delta: int = 0
    key: list[int] | None = None

    @property
    def cache_key(self) -> list[int]:
        return self.prompt if self.key is None else self.key


def clear_outputs(r: Request) -> None:
    """Clear what admitting ``r`` writes into it, so that an admission that raised can be tried again."""
    r.output_ids, r.output_logprobs, r.output_top, r.output_entropy = [], [], [], []
    r.routed, r.output_versions, r.input_logprobs, r.input_top = [], [], [], []
    r.finish = None


def plain_answer(r: Request, version: int, text: str = "", meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """The fields every answer has; ``version``: the engine's current weight version."""
    return {"text": text, "output_ids": list(r.output_ids), "meta_info": {
        "id": r.rid, "prompt_tokens": len(r.prompt), "completion_tokens": len(r.output_ids), "finish_reason": r.finish,
        # the version that sampled the last token (the current one when it sampled none)
        "weight_version": r.output_versions[-1] if r.output_versions else version, **(meta or {})}}


def answer(r: Request, text: str, version: int, routed_width: int | None,
           meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """``r``'s answer with the outputs it asked for; ``routed_width``: num_layers * top_k of a MoE model."""
    out = plain_answer(r, version, text, meta)
    meta = out["meta_info"]
    if r.output_versions and r.output_versions[0] != r.output_versions[-1]:  # an update landed mid-request
        meta["output_token_weight_versions"] = list(r.output_versions)
    if r.return_logprob:  # SGLang's [logprob, token_id, text] triples; the text is filled in on request
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(r.output_logprobs, r.output_ids)]
        if r.top_logprobs_num:
            meta["output_top_logprobs"] = [[[lp, t, None] for lp, t in top] for top in r.output_top]
        if r.logprob_start_len >= 0:
            prompt = r.prompt[r.logprob_start_len :]
            meta["input_token_logprobs"] = [[lp, t, None] for lp, t in zip(r.input_logprobs, prompt)]
            if r.top_logprobs_num:
                meta["input_top_logprobs"] = [None if top is None else [[lp, t, None] for lp, t in top]
                                              for top in r.input_top]
    if r.return_entropy:
        meta["output_token_entropy"] = list(r.output_entropy)
    if r.return_routed_experts:  # SGLang's form: base64 of int32 [tokens fed, num_layers, top_k]
        meta["routed_experts"] = encode_routed_experts(torch.cat(r.routed) if r.routed else
                                                       torch.zeros((0, routed_width), dtype=torch.int32))
    return out
