"""``exact_match`` (the response equals the label) and ``env`` (the reward the environment gave)."""

from __future__ import annotations

from miles.rewards.labels import require_label
from miles.types import Sample, SampleStatus

__all__ = ["env", "exact_match"]


def exact_match(sample: Sample, strip: bool = True, case_sensitive: bool = True) -> float:
    """1.0 when the response text equals the label (a string, or a number as its text), else 0.0. A sample
    without a label fails: an empty response must never match a missing answer."""
    response, label = sample.response_text, str(require_label(sample.label, exact_match.label_types))
    if strip:
        response, label = response.strip(), label.strip()
    if not case_sensitive:
        response, label = response.lower(), label.lower()
    return float(response == label)


exact_match.label_types = (str, int, float)  # type: ignore[attr-defined]  # miles.hookspecs.NeedsLabel


def env(sample: Sample, truncated: float = 0.0) -> float | dict[str, float]:
    """The reward the environment gave (the last non-None ``StepResult.reward`` of a multi-turn rollout).

    A trajectory cut short (TRUNCATED) before the env gave one gets ``truncated``; a finished one without
    a reward fails (the env never judged it).
    """
    if "env_reward" not in sample.metadata and sample.status is SampleStatus.TRUNCATED:
        return truncated
    if "env_reward" not in sample.metadata:
        raise ValueError("the environment gave this trajectory no reward (StepResult.reward was None at every "
                         "step); use a reward plugin (reward.name) or have the env return one")
    return sample.metadata["env_reward"]
