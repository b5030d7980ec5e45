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


class LoudReward:
    """Returns the number the label holds."""

    @miles.hookimpl
    def miles_register_rewards(self, register):
        register("loud", lambda sample: float(sample.label))


@pytest.mark.parametrize("local_mode", ["false", "true"])  # a time limit's wrapper, or none (cluster.local_mode)
def test_a_reward_beyond_reward_max_abs_fails_its_sample_naming_the_reward_and_the_bound(tmp_path, local_mode):
    def scored(*overrides):
        p = prepare("configs/quickstart.yaml", [f"run.dir={tmp_path}", "reward.name=loud",
                                                f"cluster.local_mode={local_mode}", *overrides],
                    extra_plugins=[("loud", LoudReward())])
        samples = [make_sample("", label) for label in ("1e6", "-1000000.5", "1e308", "-inf")]
        score_samples(samples, p.build("reward", "reward"))
        return [s.reason if s.status is SampleStatus.FAILED else s.reward for s in samples]

    assert scored() == [1e6, "reward: reward 'loud' returned -1000000.5, beyond reward.max_abs=1e+06 (a reward that "
                             "large overflows the advantages and the loss; raise reward.max_abs if it is meant)",
                        "reward: reward 'loud' returned 1e+308, beyond reward.max_abs=1e+06 (a reward that large "
                        "overflows the advantages and the loss; raise reward.max_abs if it is meant)",
                        "reward: reward 'loud' returned a non-finite value -inf"]
    assert scored("reward.max_abs=1e18")[:2] == [1e6, -1000000.5]


def test_rewards_no_float_holds_fail_their_sample_instead_of_the_stage():
    def reward(sample):
        return {"big": 10 ** 400, "entry": {"score": 1.0, "note": "fine"}, "flag": {"score": 1.0, "ok": True},
                "big entry": {"score": 1.0, "n": -10 ** 400}}[sample.response_text]

    samples = [make_sample(text, "1") for text in ("big", "entry", "flag", "big entry")]
    score_samples(samples, reward)
    assert [s.reason or s.reward for s in samples] == [
        "reward: reward 'reward' returned an integer too large for a float (1329 bits)",
        "reward: returned a dict whose 'note' entry is str 'fine', expected a number (a float holds it)",
        {"score": 1.0, "ok": 1.0},
        "reward: returned a dict whose 'n' entry is int of 1329 bits, expected a number (a float holds it)"]


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
