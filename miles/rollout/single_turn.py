"""The single-turn rollout function: one generation per sample."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from miles.rollout.context import RolloutContext
from miles.types import Sample, SampleStatus

__all__ = ["single_turn", "apply_generate_answer"]


def apply_generate_answer(sample: Sample, answer: dict, params: Mapping[str, Any] | None = None) -> None:
    """Append an SGLang-shaped ``/generate`` answer to a sample as policy tokens; ``params``: the
    ``sampling_params`` it was asked with (the distribution its log-probs are of; None: the run's)."""
    meta = answer["meta_info"]
    ids = list(answer["output_ids"])
    logprobs = [float(lp) for lp, _, _ in meta["output_token_logprobs"]]
    start = len(sample.response_ids)
    if params is not None:
        sample.record_sampling(start, params)
    sample.append(ids, logprobs, from_policy=True)
    sample.record_routing(meta, len(sample.prompt_ids) + start)
    sample.response_text += answer.get("text", "")
    sample.record_versions(start, meta)
    sample.turns += 1
    finish = meta["finish_reason"]["type"]
    if finish == "length":
        sample.status, sample.reason = SampleStatus.TRUNCATED, "max_new_tokens reached"
    elif finish == "abort":  # stopped mid-generation (partial rollout): kept, to be continued
        sample.status, sample.reason = SampleStatus.ABORTED, str(meta["finish_reason"].get("message", "aborted"))
    else:
        sample.status = SampleStatus.COMPLETED


async def single_turn(sample: Sample, ctx: RolloutContext) -> Sample:
    """One generation; a sample that already holds response tokens (an aborted partial rollout) is
    continued from them, within what is left of ``max_new_tokens``."""
    params = ctx.sampling_params
    if sample.response_ids:
        sample.off_policy_tokens = len(sample.response_ids)
        left = int(params.get("max_new_tokens", 16)) - len(sample.response_ids)
        if left <= 0:
            sample.status, sample.reason = SampleStatus.TRUNCATED, "max_new_tokens reached"
            return sample
        params = {**params, "max_new_tokens": left}
    images = {"image_data": [image.ref for image in sample.images]} if sample.images else {}
    answer = await ctx.engine.generate(sample.prompt_ids + sample.response_ids, params, return_logprob=True,
                                       **ctx.generate_options, **images)
    apply_generate_answer(sample, answer, params)
    return sample
