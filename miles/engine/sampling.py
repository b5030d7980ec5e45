"""Sampling parameters (SGLang names) and vectorised per-row sampling."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from miles.lazy import lazy_module
from miles.models.sampling import effective_temperature, truncated_logits, truncates

torch = lazy_module("torch")

__all__ = ["SamplingParams", "RowSampling", "sample_next", "per_position", "shown", "top_logprobs", "MAX_SAMPLES",
           "MAX_TOP_K"]


# The largest values the engine takes: top_k as SGLang keeps it (int32), and the samples one request may ask for
MAX_TOP_K = 2**31 - 1
MAX_SAMPLES = 1 << 16
MAX_TOKEN_ID = 2**63 - 1


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128  # more than the context has room for: the rest of the context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    n: int = 1

    @classmethod
    def parse(cls, params: dict[str, Any] | None) -> "SamplingParams":
        """Parse SGLang-style ``sampling_params``; a ValueError names the offending field."""
        try:  # the JSON text tells 1 from 1.0 and true, which a dict key would not
            key = json.dumps(params, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError, RecursionError):  # not plain JSON: parse (and likely fail) below
            key = None
        cached = _PARSED.get(key) if key is not None else None
        if cached is None:
            cached = cls._parse(params)
            if key is not None and len(key) <= 1024 and len(_PARSED) < 1024:
                _PARSED[key] = cached
        return cached

    @classmethod
    def _parse(cls, params: dict[str, Any] | None) -> "SamplingParams":
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"sampling_params: expected a JSON object, got {shown(params)}")
        params = dict(params or {})
        for name in sorted(set(params) & set(SGLANG_NEUTRAL)):
            value, neutral = params.pop(name), SGLANG_NEUTRAL[name]
            if not _is_neutral(value, neutral):
                raise ValueError(f"sampling_params.{name}: the embedded engine supports only {json.dumps(neutral)} "
                                 f"(SGLang's default), got {shown(value, as_json=True)}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(
                f"sampling_params: unknown parameter(s) {', '.join(shown(k) for k in unknown[:10])}; "
                f"supported: {', '.join(sorted(known))}, and SGLang's other parameters at their defaults"
            )
        stop = params.get("stop_token_ids")
        if stop is not None and not isinstance(stop, (list, tuple)):
            raise ValueError(f"sampling_params.stop_token_ids: expected a list of token ids, got {shown(stop)}")
        out = cls(**{**params, "stop_token_ids": tuple(stop or ())})
        out.check()
        return out

    def check(self) -> None:
        """Every parameter in its range; a ValueError names the first that is not (also for parameters made
        directly, which :meth:`parse` did not see)."""
        for name, expected, ok in _CHECKS:
            value = getattr(self, name)
            if not ok(value):
                raise ValueError(f"sampling_params.{name}: expected {expected}, got {shown(value)}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite_number(value: Any) -> bool:
    """An int or float that is finite as a float (a JSON integer may be too large for one)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _is_neutral(value: Any, neutral: Any) -> bool:
    """``value`` means SGLang's default ``neutral`` (null also as an empty string, list or object)."""
    if neutral is None:
        return value is None or (isinstance(value, (str, list, dict)) and not value)
    if isinstance(neutral, bool):
        return value is neutral
    return _finite_number(value) and value == neutral


_CHECKS: list[tuple[str, str, Callable[[Any], bool]]] = [
    ("max_new_tokens", "an integer >= 0", lambda v: _is_int(v) and v >= 0),
    ("temperature", "a finite number >= 0 (0: greedy)", lambda v: _finite_number(v) and v >= 0),
    ("top_p", "a number in (0, 1]", lambda v: _finite_number(v) and 0 < v <= 1),
    ("top_k", f"-1 (all tokens) or an integer in [1, {MAX_TOP_K}]",
     lambda v: _is_int(v) and (v == -1 or 1 <= v <= MAX_TOP_K)),
    ("stop_token_ids", f"a list of token ids (integers in [0, {MAX_TOKEN_ID}])",
     lambda v: isinstance(v, (tuple, list)) and all(_is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in v)),
    ("ignore_eos", "true or false", lambda v: isinstance(v, bool)),
    ("n", f"an integer in [1, {MAX_SAMPLES}]", lambda v: _is_int(v) and 1 <= v <= MAX_SAMPLES),
]


def shown(value: Any, limit: int = 80, *, as_json: bool = False) -> str:
    """``value`` as a message shows it: its repr (or JSON), cut at ``limit`` characters (a body may hold
    megabytes)."""
    try:
        text = json.dumps(value, default=repr) if as_json else repr(value)
    except (RecursionError, ValueError):  # nested too deeply, or an integer of more than 4300 digits
        return f"a {type(value).__name__} too large to show"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


_PARSED: dict[str, SamplingParams] = {}  # by the parameters' JSON text

# SGLang's other sampling parameters, accepted at their default (neutral) value only: any other value is refused
SGLANG_NEUTRAL: dict[str, Any] = {
    "min_new_tokens": 0, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "no_stop_trim": False, "stop": None,
    "stop_regex": None, "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None,
    "stream_interval": None, "logit_bias": None, "sampling_seed": None, "custom_params": None, "watermark": None,
    "beam_width": None,
}


@dataclass(frozen=True)
class RowSampling:
    """What sampling needs of a batch's per-row settings ([B] each), worked out once while the batch's rows stay the
    same: each decode step would otherwise test them again (a dozen small tensor operations, a fifth of a small
    model's step)."""

    temperature: torch.Tensor  # [B]
    top_p: torch.Tensor  # [B]
    top_k: torch.Tensor  # [B] long, -1 for off
    divisor: torch.Tensor  # [B, 1] the temperatures the logits are divided by (effective_temperature)
    truncates: bool  # some row's top-p or top-k may leave a token out
    greedy: torch.Tensor | None  # [B] bool where some row is greedy (temperature 0), else None
    all_greedy: bool

    @classmethod
    def of(cls, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> RowSampling:
        greedy = temperature == 0
        some, every = bool(greedy.any()), bool(greedy.all())
        return cls(temperature, top_p, top_k, effective_temperature(temperature).unsqueeze(-1),
                   truncates(top_p, top_k), greedy if some else None, every)


def sample_next(logits: torch.Tensor, rows: RowSampling,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The next token of each row ([B] long) of ``logits`` ([B, V] float32): drawn from
    ``softmax(truncate(logits / T))`` under ``rows``' settings, the argmax where the temperature is 0. Also the
    temperature-scaled logits and those of the truncated distribution the tokens were drawn from ([B, V] each; a
    greedy row's are its ``logits``): :mod:`miles.models.sampling` says which of the three distributions a log-prob
    is reported under (``rollout.logprobs_of``); they are its very values (``scaled_logits``, ``truncated_logits``)."""
    if rows.all_greedy:
        return logits.argmax(dim=-1), logits, logits
    scaled = logits / rows.divisor.to(logits.dtype)
    drawn = truncated_logits(scaled, rows.temperature, rows.top_p, rows.top_k) if rows.truncates else scaled
    sampled = torch.multinomial(drawn.softmax(dim=-1), 1, generator=generator).squeeze(1)
    if rows.greedy is not None:
        sampled = torch.where(rows.greedy, logits.argmax(dim=-1), sampled)
    return sampled, scaled, drawn


def per_position(params: SamplingParams, prompt: int, outputs: int, logprobs_of: str,
                 device: torch.device) -> dict[str, torch.Tensor]:
    """The distribution of each position of a prompt's ``prompt`` predictions and ``outputs`` sampled tokens, as
    :func:`miles.models.hf.exact_logprobs` takes it: the model's for the prompt, ``params``' for the outputs
    (``logprobs_of``, :mod:`miles.models.sampling`)."""
    if logprobs_of == "model":
        return {}

    def column(value: float, neutral: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([neutral] * prompt + [value] * outputs, dtype=dtype, device=device)

    out = {"temperature": column(float(params.temperature), 1.0, torch.float32)}
    if logprobs_of == "truncated":
        out["top_p"] = column(float(params.top_p), 1.0, torch.float32)
        out["top_k"] = column(params.top_k, -1, torch.long)
    return out


def top_logprobs(logprobs: torch.Tensor, k: int) -> list[list[tuple[float, int]]]:
    """The ``k`` most likely tokens of each row of ``logprobs`` [N, V], as (logprob, token id) pairs."""
    values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return [list(zip(v, i)) for v, i in zip(values.tolist(), ids.tolist())]
