"""Time limits on user functions: a reward or rollout function that never returns fails its sample
with "timed out after N s", is counted, and the run goes on (up to run.max_failed_frac).

A hung function waits on an Event that is never set (a threading.Event is set at teardown to free
the abandoned thread); no test compares wall-clock times."""

import asyncio
import json
import threading

import pytest

import miles
from miles.errors import ConfigError, RunError
from miles.rollout.context import RolloutContext
from miles.rollout.data_source import Prompt
from miles.interrupts import time_limit, with_time_limit
from miles.rollout.generate import make_groups, run_rollouts
from miles.rewards.scoring import score_samples
from miles.rollout.single_turn import single_turn
from miles.run.runner import prepare, train
from miles.testing import make_sample
from miles.types import SampleStatus

TIMED_OUT = "timed out after 0.5 s"


@pytest.fixture
def release():
    """Holds hung sync functions; set at teardown so that their abandoned threads end."""
    event = threading.Event()
    yield event
    event.set()


def test_hung_plain_reward_fails_its_sample_and_the_others_are_scored(release):
    def reward(sample):
        if sample.label == "hang":
            release.wait()
        return float(sample.response_text == sample.label)

    samples = [make_sample("1", "1"), make_sample("2", "hang"), make_sample("3", "4")]
    score_samples(samples, with_time_limit(reward, 0.5))
    assert [s.reward for s in samples] == [1.0, None, 0.0]
    assert samples[1].status is SampleStatus.FAILED and samples[1].reason == f"reward: {TIMED_OUT}"


def test_hung_async_reward_fails_its_sample():
    async def reward(sample):
        if sample.label == "hang":
            await asyncio.Event().wait()
        return 1.0

    samples = [make_sample("1", "hang"), make_sample("2", "2")]
    score_samples(samples, with_time_limit(reward, 0.5))
    assert samples[0].reason == f"reward: {TIMED_OUT}"
    assert samples[1].reward == 1.0


@pytest.mark.parametrize("is_async", [False, True])
def test_hung_batched_reward_fails_every_sample_of_the_batch(release, is_async):
    if is_async:
        async def reward(samples):
            await asyncio.Event().wait()
    else:
        def reward(samples):
            release.wait()

    samples = [make_sample("1", "1"), make_sample("2", "2")]
    score_samples(samples, with_time_limit(miles.batched(reward), 0.5))
    assert [s.reason for s in samples] == [f"reward: {TIMED_OUT}"] * 2


def test_a_timeout_error_of_the_reward_itself_is_not_a_time_limit():
    def reward(sample):
        raise TimeoutError("judge did not answer")

    sample = make_sample("1", "1")
    score_samples([sample], with_time_limit(reward, 0.5))
    assert sample.reason == "reward: TimeoutError: judge did not answer"


def test_limited_plain_rewards_run_in_daemon_threads_unlimited_ones_in_the_caller():
    seen = []

    def reward(sample):
        seen.append(threading.current_thread())
        return 1.0

    score_samples([make_sample()], with_time_limit(reward, 0))
    score_samples([make_sample()], with_time_limit(reward, 5))
    assert seen[0] is threading.main_thread()
    assert seen[1] is not threading.main_thread() and seen[1].daemon


def test_hung_rollout_fn_fails_its_sample():
    async def rollout(sample, ctx):
        if sample.index == 0:
            await asyncio.Event().wait()
        sample.status = SampleStatus.COMPLETED
        return sample

    groups = make_groups([Prompt(index=0, prompt="1+1=", prompt_ids=[1, 2], label="2")], n_samples=3)
    run_rollouts(groups, with_time_limit(rollout, 0.5), RolloutContext(engine=None, tokenizer=None))
    assert [s.status for s in groups[0].samples] == [SampleStatus.FAILED] + [SampleStatus.COMPLETED] * 2
    assert groups[0].samples[0].reason == f"rollout: {TIMED_OUT}"


class Hanging:
    """A reward and a rollout function that hang on chosen samples until ``release`` is set."""

    def __init__(self, release: threading.Event) -> None:
        self.release = release

    @miles.hookimpl
    def miles_register_rewards(self, register):
        def hang_some(sample, every: int = 2):
            if sample.index == 0 and sample.group_index % every == 0:
                self.release.wait()
            return float(sample.response_text == sample.label)

        async def hang_all(sample):
            await asyncio.Event().wait()

        register("hang_some", hang_some)
        register("hang_all", hang_all)

    @miles.hookimpl
    def miles_register_rollout_fns(self, register):
        async def hang_some_rollouts(sample, ctx):
            if sample.index == 0 and sample.group_index % 2 == 0:
                await asyncio.Event().wait()
            return await single_turn(sample, ctx)

        register("hang_some_rollouts", hang_some_rollouts)


def short_run(tmp_path, release, *overrides):
    return prepare("configs/quickstart.yaml", [
        f"run.dir={tmp_path}", "run.steps=2", "sft.steps=0", "run.eval_size=0", "run.progress=false",
        "rollout.prompts_per_step=4", "rollout.n_samples=4", *overrides,
    ], extra_plugins=[("hanging", Hanging(release))])


def metrics(tmp_path):
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_defaults_and_what_the_stages_are_given(tmp_path, release):
    p = short_run(tmp_path, release)
    assert time_limit(p.build("reward", "reward")) == 60.0
    assert time_limit(p.build("rollout_fn", "rollout.fn")) is None  # no limit unless configured
    p = short_run(tmp_path, release, "reward.timeout_s=0", "rollout.fn.timeout_s=30")
    assert time_limit(p.build("reward", "reward")) is None
    assert time_limit(p.build("rollout_fn", "rollout.fn")) == 30.0


@pytest.mark.parametrize("override", ["reward.timeout_s=-1", "rollout.fn.timeout_s=soon", "reward.timeout_s=true"])
def test_bad_timeouts_are_config_errors(tmp_path, release, override):
    key = override.partition("=")[0]
    with pytest.raises(ConfigError, match=rf"{key}: expected a number of seconds > 0, or 0 for no limit"):
        short_run(tmp_path, release, override)


def test_run_goes_on_past_hung_rewards_and_counts_them(tmp_path, release):
    train(short_run(tmp_path, release, "reward.name=hang_some", "reward.timeout_s=0.5"))
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        assert row["samples/failed"] == row["reward/timeouts"] == 2  # sample 0 of groups 0 and 2
        assert row["rollout/timeouts"] == 0
        assert row["train/samples"] <= 14


def test_run_goes_on_past_hung_partial_rollouts_and_counts_them(tmp_path, release):
    train(short_run(tmp_path, release, "rollout.fn.name=hang_some_rollouts", "rollout.fn.timeout_s=0.5",
                    "rollout.partial_rollout=true"))
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        assert row["samples/failed"] == row["rollout/timeouts"] == 2
        assert row["reward/timeouts"] == 0


def test_all_rewards_hung_stops_the_run_naming_the_timeout(tmp_path, release):
    expected = rf"16 of 16 samples failed .* above run.max_failed_frac=0.5.*reward: {TIMED_OUT}"
    with pytest.raises(RunError, match=expected):
        train(short_run(tmp_path, release, "reward.name=hang_all", "reward.timeout_s=0.5"))


def test_ctrl_c_while_a_limited_reward_runs_is_never_lost():
    """SIGINT arrives while the worker thread hands over the reward: score_samples raises KeyboardInterrupt
    every time (Python 3.11's asyncio.wait_for would swallow the cancellation and the run would go on)."""
    import os
    import signal

    def interrupting(sample):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in the middle of the reward call
        return 1.0

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, however pytest was started
    try:
        for _ in range(20):
            with pytest.raises(KeyboardInterrupt):
                score_samples([make_sample("1", "1")], with_time_limit(interrupting, 5.0))
    finally:
        signal.signal(signal.SIGINT, previous)
