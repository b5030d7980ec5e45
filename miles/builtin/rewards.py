"""Builtin rewards."""

from __future__ import annotations

from miles import hookimpl
from miles.types import Sample


def exact_match(sample: Sample, strip: bool = True, case_sensitive: bool = True) -> float:
    """1.0 when the response text equals the label, else 0.0."""
    response, label = sample.response_text, "" if sample.label is None else str(sample.label)
    if strip:
        response, label = response.strip(), label.strip()
    if not case_sensitive:
        response, label = response.lower(), label.lower()
    return float(response == label)


@hookimpl(trylast=True)
def miles_register_rewards(register):
    register("exact_match", exact_match)
