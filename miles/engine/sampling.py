"""Sampling parameters (SGLang names) and vectorised per-row sampling."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

import torch

__all__ = ["SamplingParams", "sample_next"]


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    n: int = 1

    @classmethod
    def parse(cls, params: dict[str, Any] | None) -> "SamplingParams":
        """Parse SGLang-style ``sampling_params``; a ValueError names the offending field."""
        try:
            key = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in (params or {}).items()))
            cached = _PARSED.get(key)
        except TypeError:  # unhashable values: parse (and fail) below
            key, cached = None, None
        if cached is None:
            cached = cls._parse(params)
            if key is not None and len(_PARSED) < 1024:
                _PARSED[key] = cached
        return cached

    @classmethod
    def _parse(cls, params: dict[str, Any] | None) -> "SamplingParams":
        params = dict(params or {})
        for name in sorted(set(params) & set(SGLANG_NEUTRAL)):
            value, neutral = params.pop(name), SGLANG_NEUTRAL[name]
            if value != neutral and not (neutral is None and value in ("", [], {})):
                raise ValueError(f"sampling_params.{name}: the embedded engine supports only {json.dumps(neutral)} "
                                 f"(SGLang's default), got {json.dumps(value, default=repr)}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(
                f"sampling_params: unknown parameter(s) {', '.join(map(repr, unknown))}; "
                f"supported: {', '.join(sorted(known))}, and SGLang's other parameters at their defaults"
            )
        out = cls(**{**params, "stop_token_ids": tuple(params.get("stop_token_ids") or ())})
        checks = [
            ("max_new_tokens", isinstance(out.max_new_tokens, int) and out.max_new_tokens >= 0, "an integer >= 0"),
            ("temperature", isinstance(out.temperature, (int, float)) and out.temperature >= 0, "a number >= 0"),
            ("top_p", isinstance(out.top_p, (int, float)) and 0 < out.top_p <= 1, "a number in (0, 1]"),
            ("top_k", isinstance(out.top_k, int) and (out.top_k == -1 or out.top_k >= 1), "-1 or an integer >= 1"),
            ("n", isinstance(out.n, int) and out.n >= 1, "an integer >= 1"),
            ("stop_token_ids", all(isinstance(t, int) for t in out.stop_token_ids), "a list of token ids"),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"sampling_params.{name}: expected {expected}, got {getattr(out, name)!r}")
        return out


_PARSED: dict[tuple, SamplingParams] = {}

# SGLang's other sampling parameters, accepted at their default (neutral) value only: any other value is refused
SGLANG_NEUTRAL: dict[str, Any] = {
    "min_new_tokens": 0, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "no_stop_trim": False, "stop": None,
    "stop_regex": None, "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None,
    "stream_interval": None, "logit_bias": None, "sampling_seed": None, "custom_params": None, "watermark": None,
    "beam_width": None,
}


def sample_next(
    logits: torch.Tensor,  # [B, V] float32
    temperature: torch.Tensor,  # [B]
    top_p: torch.Tensor,  # [B]
    top_k: torch.Tensor,  # [B] long, -1 for off
    generator: torch.Generator | None,
) -> torch.Tensor:  # [B] long
    greedy = temperature == 0
    if bool(greedy.all()):
        return logits.argmax(dim=-1)
    scaled = logits / temperature.clamp(min=1e-5).unsqueeze(1)
    if bool(((top_k > 0) | (top_p < 1)).any()):
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        ranks = torch.arange(scaled.shape[-1], device=scaled.device).unsqueeze(0)
        k = torch.where(top_k > 0, top_k, scaled.shape[-1]).unsqueeze(1)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop = (ranks >= k) | (mass_before > top_p.unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.empty_like(scaled).scatter_(-1, order, sorted_logits)
    sampled = torch.multinomial(scaled.softmax(dim=-1), 1, generator=generator).squeeze(1)
    if bool(greedy.any()):
        sampled = torch.where(greedy, logits.argmax(dim=-1), sampled)
    return sampled
