"""The single-turn rollout function: one generation per sample."""

from __future__ import annotations

from miles.rollout.context import RolloutContext
from miles.types import Sample, SampleStatus

__all__ = ["single_turn", "apply_generate_answer"]


def apply_generate_answer(sample: Sample, answer: dict) -> None:
    """Append an SGLang-shaped ``/generate`` answer to a sample as policy tokens."""
    meta = answer["meta_info"]
    ids = list(answer["output_ids"])
    logprobs = [float(lp) for lp, _, _ in meta["output_token_logprobs"]]
    sample.append(ids, logprobs, from_policy=True)
    sample.response_text += answer.get("text", "")
    sample.weight_versions.append(int(meta["weight_version"]))
    sample.turns += 1
    if meta["finish_reason"]["type"] == "length":
        sample.status, sample.reason = SampleStatus.TRUNCATED, "max_new_tokens reached"
    else:
        sample.status = SampleStatus.COMPLETED


async def single_turn(sample: Sample, ctx: RolloutContext) -> Sample:
    answer = await ctx.engine.generate(sample.prompt_ids, ctx.sampling_params, return_logprob=True)
    apply_generate_answer(sample, answer)
    return sample
