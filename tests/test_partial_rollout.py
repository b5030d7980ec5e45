"""Partial rollout: once the batch is full, samples still generating are stopped, kept with their
tokens, and continued in the next step under the new weights (a real engine with a worker thread)."""

import pytest

from miles.builtin.selectors import OverSampling
from miles.engine.local import LocalEngine
from miles.models.hf import load_tokenizer
from miles.rollout.collect import GroupCollector
from miles.rollout.context import RolloutContext
from miles.rollout.data_source import PromptSource
from miles.rollout.single_turn import single_turn
from miles.types import SampleStatus, TrainBatch

LONG = 40


def quick_then_long(sample, ctx):
    """Rows 0 and 1 answer in one token; the others generate LONG tokens (EOS ignored)."""
    quick = sample.metadata["row"] < 2
    params = {**ctx.sampling_params, "max_new_tokens": 1 if quick else LONG, "ignore_eos": not quick}
    return single_turn(sample, RolloutContext(ctx.engine, ctx.tokenizer, params, ctx.run))


@pytest.fixture
def engine(tiny_model_dir):
    engine = LocalEngine(background=True, seed=0)
    engine.load_model(str(tiny_model_dir))
    yield engine
    engine.close()


def test_unfinished_samples_are_kept_and_continued_under_new_weights(engine, tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    rows = [{"prompt": f"{i}+{i}="} for i in range(8)]
    data = PromptSource(rows, tokenizer, prompt_key="prompt", label_key="label", chat_template="false",
                        shuffle=False, seed=0)
    collector = GroupCollector([("over_sampling", OverSampling(factor=3.0))], prompts_per_step=2, n_samples=2,
                               partial_rollout=True)
    ctx = RolloutContext(engine, tokenizer, {"temperature": 1.0, "max_new_tokens": LONG})

    def collect():
        return collector.collect(data, quick_then_long, ctx, lambda sample: 1.0, lambda samples: None)

    first = collect()  # 6 prompts for a batch of 2: rows 0 and 1 finish first, rows 2-5 are stopped
    assert sorted(g.samples[0].metadata["row"] for g in first.groups) == [0, 1]
    assert len(first.samples) == 4 and first.metrics["rollout/partial_groups"] == 4  # nothing counted twice
    partial = [s for g in collector.unfinished for s in g.samples]
    assert all(s.status is SampleStatus.ABORTED for s in partial)
    assert any(0 < len(s.response_ids) < LONG for s in partial)  # stopped mid-generation, tokens kept
    for s in partial:
        assert len(s.response_ids) == len(s.loss_mask) == len(s.rollout_logprobs)
    before = {id(s): (list(s.response_ids), list(s.rollout_logprobs)) for s in partial}

    engine.update_weights({k: v.clone() for k, v in engine.model.state_dict().items()}, weight_version=7)
    second = collect()  # rows 2-5 are continued from their tokens, next to new rows 6 and 7
    assert {g.samples[0].metadata["row"] for g in second.groups} <= set(range(2, 8))
    continued = [s for g in second.groups for s in g.samples if id(s) in before]
    assert continued and any(s.off_policy_tokens > 0 for s in continued)
    for s in continued:
        ids, logprobs = before[id(s)]
        assert s.response_ids[: len(ids)] == ids and s.rollout_logprobs[: len(ids)] == logprobs
        assert s.off_policy_tokens == len(ids) and len(s.response_ids) == LONG  # the budget is shared
        assert s.weight_versions[-1] == 7 and s.status is SampleStatus.TRUNCATED
    assert second.metrics["rollout/off_policy_token_frac"] > 0

    batch = TrainBatch.from_samples(continued, pad_token_id=0)
    assert batch.num_tokens == sum(len(s.response_ids) for s in continued)  # token and log-prob alignment
    for i, s in enumerate(continued):
        start = len(s.prompt_ids) - 1
        assert (batch.rollout_logprobs[i, start: start + len(s.response_ids)].tolist()
                == pytest.approx(s.rollout_logprobs))


def test_off_policy_tokens_can_be_left_out_of_the_loss():
    from miles.types import Sample

    sample = Sample(prompt_ids=[1], response_ids=[5, 6, 7, 8], loss_mask=[1, 1, 1, 0],
                    rollout_logprobs=[-1.0] * 4, off_policy_tokens=2)
    sample.mask_off_policy()
    assert sample.loss_mask == [0, 0, 1, 0] and sample.response_ids == [5, 6, 7, 8]
