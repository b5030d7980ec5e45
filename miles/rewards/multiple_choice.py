"""The ``multiple_choice`` reward: the letter the response chose against the label's letter."""

from __future__ import annotations

import functools
import re
from typing import Any

from miles.rewards.labels import require_label
from miles.types import Sample

__all__ = ["extract_choice", "multiple_choice"]


def multiple_choice(sample: Sample, choices: str = "ABCDE") -> float:
    """1.0 when the letter the response chose (:func:`extract_choice`) is the label's, else 0.0.

    The label is a letter of ``choices`` (any case, ``"(B)"`` and ``"B."`` too); any other label fails
    the sample. A response without a choice scores 0 (``sample.metadata["reward_info"]`` says so).
    """
    letters = choices.upper()
    label = re.fullmatch(r"\W*([A-Za-z])\W*", require_label(sample.label, multiple_choice.label_types))
    if label is None or label.group(1).upper() not in letters:
        raise ValueError(f"the label {sample.label!r} is not one of the choices {letters}")
    chosen = extract_choice(sample.response_text, letters)
    sample.metadata["reward_info"] = {"answer": chosen} if chosen else {"reason": "no choice found"}
    return float(chosen == label.group(1).upper())


def _check_choices(args: dict[str, Any]) -> None:
    choices = args["choices"]
    if not (isinstance(choices, str) and choices.isalpha() and choices.isascii()
            and len(set(choices.upper())) == len(choices) >= 2):
        raise ValueError(f"choices: expected two or more distinct letters, e.g. ABCD, got {choices!r}")


multiple_choice.check_args = _check_choices  # type: ignore[attr-defined]
multiple_choice.label_types = (str,)  # type: ignore[attr-defined]  # miles.hookspecs.NeedsLabel


def extract_choice(text: str, choices: str = "ABCDE") -> str | None:
    """The letter a response chose, upper-cased; None when it chose none.

    Explicit statements come first: "answer is B", "Answer: (b)", "the correct option is C", ``\\boxed{D}``;
    the last one wins. Without one, the last of the bare forms: "(B)", "[B]", "B." or "B)" before a space or the end,
    ``**B**``, or a line holding only the letter. A lower-case letter counts only in an explicit statement
    and before punctuation or the line's end ("the answer is b."), so that "the answer is a bit" is no choice.
    """
    explicit, bare = _patterns(choices.upper())
    for pattern in (explicit, bare):
        matches = list(pattern.finditer(text))
        if matches:
            return next(g for g in matches[-1].groups() if g).upper()
    return None


@functools.cache
def _patterns(letters: str) -> tuple[re.Pattern, re.Pattern]:
    upper, lower = f"[{letters}]", f"[{letters.lower()}]"
    letter = rf"({upper}(?![A-Za-z0-9])|{lower}(?=[ \t]*(?:[.,;:!?)\]*]|$)))"
    explicit = re.compile(
        rf"(?i:\b(?:answer|(?:correct|right|best)\s+(?:option|choice))\b(?:\s+is)?(?:\s*[:=])?[ \t]*(?:\*\*|\$)?"
        rf"[ \t]*(?:(?:option|choice)[ \t]+)?)[(\[]?[ \t]*{letter}"
        rf"|\\boxed\{{\s*(?:\\text\{{\s*)?\(?({upper})", re.MULTILINE)
    bare = re.compile(
        rf"(?<![A-Za-z0-9])[(\[]({upper})[)\]]|(?<![A-Za-z0-9])({upper})[.)](?=\s|$)|\*\*({upper})\*\*"
        rf"|^[^\w\n]*({upper})[^\w\n]*$", re.MULTILINE)
    return explicit, bare
