"""The reward stage: plain, async and batched rewards; failures recorded per sample and counted."""

import json
import math

import pytest

import miles
from miles.errors import RunError
from miles.rewards.scoring import score_samples
from miles.run.runner import prepare, train
from miles.testing import make_sample
from miles.types import SampleStatus


def test_plain_reward_and_failures_per_sample():
    samples = [make_sample("1", "1"), make_sample("x", "1"), make_sample("nan", "1"), make_sample("d", "1")]

    def reward(sample):
        if sample.response_text == "x":
            raise KeyError("no verdict")
        if sample.response_text == "nan":
            return math.nan
        if sample.response_text == "d":
            return {"accuracy": 1.0}
        return 1.0

    score_samples(samples, reward)
    assert samples[0].reward == 1.0 and samples[0].status is SampleStatus.COMPLETED
    assert samples[1].status is SampleStatus.FAILED and samples[1].reason == "reward: KeyError: 'no verdict'"
    assert samples[2].status is SampleStatus.FAILED and "non-finite" in samples[2].reason
    assert samples[3].status is SampleStatus.FAILED and "without a 'score' entry" in samples[3].reason


def test_dict_reward_uses_score():
    sample = make_sample("1", "1")
    score_samples([sample], lambda s: {"score": 0.5, "format": 1.0})
    assert sample.scalar_reward == 0.5 and sample.reward == {"score": 0.5, "format": 1.0}


def test_async_reward():
    async def reward(sample):
        if sample.label == "boom":
            raise ValueError("judge unavailable")
        return float(len(sample.response_text))

    samples = [make_sample("abc", "1"), make_sample("", "boom")]
    score_samples(samples, reward)
    assert samples[0].reward == 3.0
    assert samples[1].reason == "reward: ValueError: judge unavailable"


def test_batched_reward():
    seen = []

    @miles.batched
    def reward(samples):
        seen.append(len(samples))
        return [float(s.response_text == s.label) for s in samples]

    samples = [make_sample("1", "1"), make_sample("2", "1"), make_sample("3", "3")]
    samples[1].status = SampleStatus.FAILED  # failed in rollout: not scored
    score_samples(samples, reward)
    assert seen == [2]
    assert [s.reward for s in samples] == [1.0, None, 1.0]


def test_batched_reward_with_wrong_count_fails_all():
    samples = [make_sample("1", "1"), make_sample("2", "2")]
    score_samples(samples, miles.batched(lambda ss: [1.0]))
    assert all("returned 1 rewards for 2 samples" in s.reason for s in samples)


class FlakyReward:
    """Raises for every second sample of each group, else exact match."""

    @miles.hookimpl
    def miles_register_rewards(self, register):
        def flaky(sample, fail_every: int = 2):
            if sample.index % fail_every == 1:
                raise RuntimeError("grader crashed")
            return float(sample.response_text == sample.label)

        register("flaky", flaky)


def short_run(tmp_path, *overrides):
    return prepare("configs/quickstart.yaml", [
        f"run.dir={tmp_path}", "run.steps=3", "sft.steps=0", "run.eval_size=0", "run.progress=false",
        "rollout.prompts_per_step=4", "rollout.n_samples=4", "reward.name=flaky", *overrides,
    ], extra_plugins=[("flaky", FlakyReward())])


def test_failed_samples_are_counted_and_the_run_goes_on(tmp_path):
    train(short_run(tmp_path, "run.max_failed_frac=1.0"))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for row in rows:
        assert row["samples/total"] == 16
        assert row["samples/failed"] == 8
        assert row["train/samples"] <= 16 - row["samples/failed"]  # failed samples are never trained on


def test_too_many_failures_stop_the_run(tmp_path):
    with pytest.raises(RunError, match=r"samples failed .* above run.max_failed_frac=0.0.*grader crashed"):
        train(short_run(tmp_path, "run.max_failed_frac=0.0"))
