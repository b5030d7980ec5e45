"""The ``format`` reward: whether the response matches a regular expression, alone or with another reward."""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from miles.types import Sample

__all__ = ["FormatReward"]

MODES = ("gate", "add")
_FLAGS = {"a": re.ASCII, "i": re.IGNORECASE, "m": re.MULTILINE, "s": re.DOTALL, "x": re.VERBOSE}


class FormatReward:
    """1.0 when the response matches ``pattern`` (``re.search``; ``full_match``: the whole response),
    else 0.0, times ``weight``. ``flags`` are letters of ``re``'s inline flags: ``i`` (ignore case),
    ``m`` (multiline), ``s`` (``.`` matches newlines), ``x`` (verbose), ``a`` (ASCII).

    With an inner ``reward`` (a reward node, built like the top one):

    - ``mode: gate``: the inner reward's score when the format matches, else 0.0 (the inner reward is
      not called);
    - ``mode: add``: the inner reward's score plus ``weight`` x match.

    The result is a dict: ``score``, ``format`` (1.0 or 0.0) and the inner reward's other entries.
    """

    miles_components = {"reward": "reward"}  # the inner reward is a node, built before this constructor runs

    def __init__(self, pattern: str, flags: str = "", full_match: bool = False, reward: Any = None,
                 mode: str = "gate", weight: float = 1.0) -> None:
        self.check_args({"pattern": pattern, "flags": flags, "mode": mode, "weight": weight})
        if isinstance(reward, (str, Mapping)):
            raise TypeError(f"reward: expected a reward function; a config node ({reward!r}) is built by the "
                            f"registry (Registry.build) before it reaches this constructor")
        if reward is not None and getattr(getattr(reward, "func", reward), "miles_batched", False):
            raise ValueError("reward: a batched reward scores a whole step at once; format wraps one sample's reward")
        self.regex = _compile(pattern, flags)
        self.full_match, self.inner, self.mode, self.weight = full_match, reward, mode, float(weight)
        if reward is not None and _is_async(reward):
            self.__class__ = _AsyncFormatReward  # run concurrently by the reward stage, as the inner reward would be

    @staticmethod
    def check_args(args: dict[str, Any]) -> None:
        """Config validation: the pattern compiles with its flags, the mode and weight are known values."""
        _compile(args["pattern"], args.get("flags", ""))
        if args.get("mode", "gate") not in MODES:
            raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {args['mode']!r}")
        weight = args.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ValueError(f"weight: expected a finite number, got {weight!r}")

    def matches(self, text: str) -> bool:
        return (self.regex.fullmatch(text) if self.full_match else self.regex.search(text)) is not None

    def __call__(self, sample: Sample) -> dict[str, float] | Any:
        matched = float(self.matches(sample.response_text))
        if self.inner is None or (self.mode == "gate" and not matched):
            return {"score": matched * (self.weight if self.inner is None else 1.0), "format": matched}
        value = self.inner(sample)
        if inspect.isawaitable(value):  # a plain function that returned an awaitable: the stage awaits this
            return self._combine_later(matched, value)
        return self._combine(matched, value)

    async def _combine_later(self, matched: float, value: Any) -> dict[str, float]:
        return self._combine(matched, await value)

    def _combine(self, matched: float, value: Any) -> dict[str, float]:
        if isinstance(value, dict) and "score" not in value:
            raise ValueError(f"the inner reward returned a dict without a 'score' entry (keys: {', '.join(value)})")
        inner = value["score"] if isinstance(value, dict) else value
        extras = {k: v for k, v in value.items() if k != "score"} if isinstance(value, dict) else {}
        score = inner if self.mode == "gate" else inner + self.weight * matched
        return {**extras, "score": score, "format": matched}


class _AsyncFormatReward(FormatReward):
    """:class:`FormatReward` around an async reward."""

    async def __call__(self, sample: Sample) -> dict[str, float]:
        value = super().__call__(sample)
        return await value if inspect.isawaitable(value) else value


def _compile(pattern: Any, flags: Any) -> re.Pattern:
    if not isinstance(pattern, str):
        raise ValueError(f"pattern: expected a regular expression (a string), got {pattern!r}")
    if not isinstance(flags, str) or set(flags) - set(_FLAGS):
        raise ValueError(f"flags: expected letters of {''.join(_FLAGS)} (e.g. 'is'), got {flags!r}")
    try:
        return re.compile(pattern, sum(_FLAGS[f] for f in set(flags)))
    except re.error as exc:
        raise ValueError(f"pattern: {pattern!r} is not a valid regular expression: {exc}") from None


def _is_async(fn: Callable) -> bool:
    """Whether the reward stage runs ``fn`` as an async reward (a coroutine function, or a callable object
    whose ``__call__`` is one; a ``functools.partial`` of either)."""
    target = getattr(fn, "func", fn)
    return inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(getattr(target, "__call__", None))
