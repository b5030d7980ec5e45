"""The ``f1`` reward: token overlap between the response and the label, as SQuAD scores answers."""

from __future__ import annotations

import re
import string
from collections import Counter

from miles.rewards.labels import require_label
from miles.types import Sample

__all__ = ["normalize_answer", "token_f1"]

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def token_f1(sample: Sample) -> float:
    """The F1 of the response's tokens against the label's (SQuAD normalisation: lower case, no
    punctuation, no articles, split on whitespace); a list label scores against its best entry.
    Two empty texts score 1.0, one empty text 0.0."""
    label = require_label(sample.label, token_f1.label_types)
    labels = label if isinstance(label, (list, tuple)) else [label]
    response = normalize_answer(sample.response_text).split()
    return max(_f1(response, normalize_answer(str(label)).split()) for label in labels)


token_f1.label_types = (str, int, float, list)  # type: ignore[attr-defined]  # miles.hookspecs.NeedsLabel


def normalize_answer(text: str) -> str:
    """SQuAD's answer normalisation: lower case, punctuation and articles removed, whitespace collapsed."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def _f1(response: list[str], label: list[str]) -> float:
    if not response or not label:
        return float(response == label)
    common = sum((Counter(response) & Counter(label)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(response), common / len(label)
    return 2 * precision * recall / (precision + recall)
