"""Time limits on user functions: a reward or rollout function that never returns fails its sample
with "timed out after N s", is counted, and the run goes on (up to run.max_failed_frac).

A reward that hangs on every sample stops the run within a few times its limit, naming it, whatever its
form (plain, async, batched, a remote judge over HTTP, the math reward's comparison process): a plain
one is called at most HUNG_AFTER times in a row past its limit, the others run every limit at once.

A hung function waits on an Event that is never set (a threading.Event is set at teardown to free
the abandoned thread); no test compares wall-clock times: they count calls."""

import asyncio
import dataclasses
import json
import os
import signal
import threading
import time
import urllib.request

import pytest

import miles
from miles.errors import ConfigError, RunError
from miles.rollout.context import RolloutContext
from miles.rollout.data_source import Prompt
from miles.interrupts import time_limit, with_time_limit
from miles.rollout.generate import make_groups, run_rollouts
from miles.rewards import math_answer, scoring
from miles.rewards.scoring import HUNG_AFTER, score_samples, score_samples_async
from miles.rollout.single_turn import single_turn
from miles.run.runner import prepare, train
from miles.testing import make_sample
from miles.types import SampleStatus

TIMED_OUT = "timed out after 0.5 s"


def timed_out(name: str, limit: str = "0.5") -> str:
    return f"reward: timed out after {limit} s (reward {name!r}, reward.timeout_s)"


def not_scored(name: str, limit: str = "0.5") -> str:
    return (f"reward: not scored: reward {name!r} looks hung (its last {HUNG_AFTER} calls in a row ran past "
            f"reward.timeout_s={limit} s)")


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
    assert samples[1].status is SampleStatus.FAILED and samples[1].reason == timed_out("reward")


def test_hung_async_reward_fails_its_sample():
    async def reward(sample):
        if sample.label == "hang":
            await asyncio.Event().wait()
        return 1.0

    samples = [make_sample("1", "hang"), make_sample("2", "2")]
    score_samples(samples, with_time_limit(reward, 0.5))
    assert samples[0].reason == timed_out("reward")
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
    assert [s.reason for s in samples] == [timed_out("reward")] * 2


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


def test_limited_plain_rewards_reuse_idle_threads_and_a_hung_one_keeps_only_its_own(release):
    """Each scoring job takes a daemon thread idle since its last job (starting one costs milliseconds under a busy
    interpreter); a thread in a hung call is never handed another job, and serves again once the call returns."""
    seen = []

    def reward(sample):
        seen.append(threading.current_thread())
        if sample.label == "hang":
            release.wait()
        return 1.0

    def idle_threads(count):  # wait until ``count`` threads wait for work (a job's thread goes back after it)
        deadline = time.monotonic() + 60
        while len(scoring._idle) < count:
            assert time.monotonic() < deadline, "a reward thread never went back to waiting for work"
            time.sleep(0.001)

    limited = with_time_limit(reward, 0.5)
    score_samples([make_sample("1", "1")], limited)
    idle_threads(1)
    before, threads = len(scoring._idle), set(threading.enumerate())
    score_samples([make_sample("1", "1")], limited)
    assert seen[1] in threads and seen[1].daemon  # a thread back from its last job took this one: none started
    assert set(threading.enumerate()) == threads
    idle_threads(before)
    hung = [make_sample("1", "hang")]
    score_samples(hung, limited)
    assert hung[0].reason == timed_out("reward") and seen[2].is_alive()
    assert len(scoring._idle) == before - 1  # the hung call's thread is not waiting for work
    score_samples([make_sample("1", "1")], limited)
    assert seen[3] is not seen[2]
    idle_threads(before - 1)
    release.set()
    idle_threads(before)  # the hung call returned: its thread waits for work again
    assert seen[2].is_alive()


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
    expected = rf"16 of 16 samples failed .* above run.max_failed_frac=0.5.*reward: {TIMED_OUT} \(reward 'hang_all'"
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


# -- a reward that hangs on every sample: the run stops within a few limits, naming it ------------------------


class Calls:
    """The calls a hung reward got (the group of each), and the most that were in flight at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.groups: list[int] = []
        self.in_flight = self.most = 0

    @property
    def started(self) -> int:
        return len(self.groups)

    def enter(self, group: int = 0) -> None:
        with self.lock:
            self.groups.append(group)
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)

    def leave(self) -> None:
        with self.lock:
            self.in_flight -= 1


def test_a_plain_reward_hung_on_every_sample_is_called_only_a_few_times(release):
    calls = Calls()

    def hang(sample):
        calls.enter()
        release.wait()

    samples = [make_sample(str(i), str(i)) for i in range(10)]
    score_samples(samples, with_time_limit(hang, 0.5))
    assert calls.started == HUNG_AFTER
    assert [s.reason for s in samples] == [timed_out("hang")] * HUNG_AFTER + [not_scored("hang")] * (10 - HUNG_AFTER)
    assert all(s.status is SampleStatus.FAILED and s.reward is None for s in samples)


def test_a_limited_plain_reward_scores_every_sample_without_a_round_trip_to_the_event_loop():
    """The reward's thread calls sample after sample on its own: here the event loop is blocked (by a task that
    waits for the last call) while all are scored. A thread that waited for the loop to take each outcome
    would score one sample, then never the last (the wait gives up after 60 s and the test fails)."""
    last_called = threading.Event()
    threads = set()

    def reward(sample):
        threads.add(threading.get_ident())
        if sample.index == 9:
            last_called.set()
        return float(sample.response_text == sample.label)

    samples = [make_sample(str(i), str(i % 2), index=i) for i in range(10)]

    async def main():
        async def block_the_loop():
            await asyncio.sleep(0)
            assert last_called.wait(60), "the reward's thread waited for the event loop between calls"

        blocker = asyncio.get_running_loop().create_task(block_the_loop())
        await score_samples_async(samples, with_time_limit(reward, 30))
        await blocker

    asyncio.run(main())
    assert [s.reward for s in samples] == [float(str(i) == str(i % 2)) for i in range(10)]
    assert len(threads) == 1 and threading.get_ident() not in threads


def test_only_calls_in_a_row_past_the_limit_make_a_plain_reward_hung(release):
    """A call in time between two time-outs starts the count again; the third time-out in a row ends it."""
    pattern = ["hang", "hang", "ok", "hang", "hang", "hang", "ok"]
    called = []

    def reward(sample):
        called.append(sample.index)
        if sample.label == "hang":
            release.wait()
        return 1.0

    samples = [make_sample("", label, index=i) for i, label in enumerate(pattern)]
    score_samples(samples, with_time_limit(reward, 0.5))
    assert called == [0, 1, 2, 3, 4, 5]
    assert [s.reward for s in samples] == [None, None, 1.0, None, None, None, None]
    assert [s.reason or None for s in samples] == [timed_out("reward")] * 2 + [None] + [timed_out("reward")] * 3 + [
        not_scored("reward")]


def test_a_plain_reward_whose_awaitable_never_ends_is_hung_too():
    calls = Calls()

    def judge(sample):
        calls.enter()
        return asyncio.Event().wait()  # a plain function handing the stage an awaitable

    samples = [make_sample(str(i), str(i)) for i in range(5)]
    score_samples(samples, with_time_limit(judge, 0.5))
    assert calls.started == HUNG_AFTER
    assert [s.reason for s in samples] == [timed_out("judge")] * HUNG_AFTER + [not_scored("judge")] * 2


def test_an_async_reward_hung_on_every_sample_runs_every_limit_at_once():
    calls = Calls()

    async def hang(sample):
        calls.enter()
        try:
            await asyncio.Event().wait()
        finally:
            calls.leave()

    samples = [make_sample(str(i), str(i)) for i in range(12)]
    score_samples(samples, with_time_limit(hang, 0.5))
    assert calls.started == calls.most == 12 and calls.in_flight == 0  # one limit for all, every call cancelled
    assert [s.reason for s in samples] == [timed_out("hang")] * 12


HUNG_WORKER = r'''
import os, sys
open(os.path.join(os.environ["MILES_TEST_WORKER_PIDS"], str(os.getpid())), "w").close()
print('{"ready": true}', flush=True)
sys.stdin.read()  # takes the request and never answers
'''


@pytest.fixture
def hung_math_worker(tmp_path, monkeypatch):
    """The math reward's comparison processes start and never answer; each one's pid is a file in the folder
    yielded, and they are killed at teardown (which frees the reward threads waiting on them)."""
    pids = tmp_path / "worker-pids"
    pids.mkdir()
    script = tmp_path / "hung_worker.py"
    script.write_text(HUNG_WORKER)
    monkeypatch.setattr(math_answer, "WORKER_SCRIPT", str(script))
    monkeypatch.setattr(math_answer, "_POOL", math_answer._WorkerPool())  # no idle worker of an earlier test
    monkeypatch.setenv("MILES_TEST_WORKER_PIDS", str(pids))
    yield pids
    for pid in pids.iterdir():
        try:
            os.kill(int(pid.name), signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_the_math_reward_whose_comparison_process_never_answers_is_hung(hung_math_worker, miles_registry):
    reward = miles_registry.build("reward", {"name": "math", "compare_timeout_s": 3600}, "reward")
    samples = [make_sample(f"so \\boxed{{y^{i}}}", "x^2") for i in range(6)]  # not plain numbers: compared in a process
    score_samples(samples, with_time_limit(reward, 0.5))
    assert len(list(hung_math_worker.iterdir())) == HUNG_AFTER  # one comparison process per call, each abandoned
    assert [s.reason for s in samples] == [timed_out("math_reward")] * HUNG_AFTER + [not_scored("math_reward")] * 3


class HungJudge:
    """A remote judge on 127.0.0.1 that takes every request and never answers: its handler waits on an event set
    only at teardown. ``requests`` counts what reached it."""

    def __init__(self) -> None:
        from aiohttp import web

        self.requests = 0
        self.arrived = threading.Condition()
        self.loop = asyncio.new_event_loop()
        self.released = asyncio.Event()
        app = web.Application()
        app.router.add_post("/score", self.score)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", 0).start())
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}/score"
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    async def score(self, request):
        from aiohttp import web

        with self.arrived:
            self.requests += 1
            self.arrived.notify_all()
        await self.released.wait()
        return web.json_response({"score": 0.0})

    def received(self, count: int) -> bool:
        """Whether ``count`` requests arrived (waiting for them: a request sent is not yet one handled)."""
        with self.arrived:
            return self.arrived.wait_for(lambda: self.requests >= count, timeout=60)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.released.set)
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


@pytest.fixture
def judge():
    server = HungJudge()
    yield server
    server.close()


class HungRewards:
    """A reward of every form, each hanging on every sample: plain, async, batched, a remote judge asked over HTTP
    from async code (aiohttp) and from plain code (urllib), and the math reward waiting on its comparison process."""

    def __init__(self, release: threading.Event, judge_url: str) -> None:
        self.release, self.url, self.calls = release, judge_url, Calls()

    @miles.hookimpl
    def miles_register_rewards(self, register):
        import aiohttp

        calls, release, url = self.calls, self.release, self.url

        def hang_plain(sample):
            calls.enter(sample.group_index)
            release.wait()

        async def hang_async(sample):
            calls.enter(sample.group_index)
            await asyncio.Event().wait()

        @miles.batched
        def hang_batched(samples):
            calls.enter()
            release.wait()

        async def hang_judge(sample):
            calls.enter(sample.group_index)
            async with aiohttp.ClientSession() as session, session.post(url, json={"text": sample.response_text}) as r:
                return (await r.json())["score"]

        def hang_judge_sync(sample):
            calls.enter(sample.group_index)
            request = urllib.request.Request(url, data=json.dumps({"text": sample.response_text}).encode(),
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request) as answer:
                return json.load(answer)["score"]

        def hang_math(sample):
            calls.enter(sample.group_index)
            return math_answer.math_reward(dataclasses.replace(sample, response_text="\\boxed{y^2}"),
                                           compare_timeout_s=3600.0)

        for reward in (hang_plain, hang_async, hang_batched, hang_judge, hang_judge_sync, hang_math):
            register(reward.__name__, reward)


# (reward, how many calls it gets in a step of 16 samples): plain ones HUNG_AFTER in a row, async ones all at once
FORMS = [("hang_plain", HUNG_AFTER), ("hang_judge_sync", HUNG_AFTER), ("hang_math", HUNG_AFTER), ("hang_async", 16),
         ("hang_judge", 16), ("hang_batched", 1)]


@pytest.mark.parametrize("name, expected_calls", FORMS)
def test_a_reward_hung_on_every_sample_stops_the_run_at_the_first_step_naming_it(
        tmp_path, release, judge, hung_math_worker, name, expected_calls):
    rewards = HungRewards(release, judge.url)
    p = prepare("configs/quickstart.yaml", [
        f"run.dir={tmp_path / 'run'}", "run.steps=3", "sft.steps=0", "run.eval_size=0", "run.progress=false",
        "rollout.prompts_per_step=4", "rollout.n_samples=4", f"reward.name={name}", "reward.timeout_s=0.5",
    ], extra_plugins=[("hung", rewards)])
    with pytest.raises(RunError) as err:
        train(p)
    message = str(err.value)
    assert message.startswith("step 0: 16 of 16 samples failed (100%), above run.max_failed_frac=0.5")
    assert timed_out(name) in message
    assert rewards.calls.started == expected_calls
    if expected_calls == HUNG_AFTER:
        assert not_scored(name) in message
    if expected_calls == 16:
        assert rewards.calls.most == 16  # every limit ran at once
    if name == "hang_judge_sync":
        assert judge.received(HUNG_AFTER) and judge.requests == HUNG_AFTER  # each call reached the judge, and hung
    if name == "hang_math":
        assert len(list(hung_math_worker.iterdir())) == HUNG_AFTER


def test_a_hung_plain_reward_in_the_async_schedule_stops_the_run_with_a_few_calls_per_group(tmp_path, release, judge):
    rewards = HungRewards(release, judge.url)
    p = prepare("configs/quickstart.yaml", [
        f"run.dir={tmp_path / 'run'}", "run.steps=3", "sft.steps=0", "run.eval_size=0", "run.progress=false",
        "rollout.prompts_per_step=4", "rollout.n_samples=4", "reward.name=hang_plain", "reward.timeout_s=0.5",
        "run.schedule=async",
    ], extra_plugins=[("hung", rewards)])
    # however many samples the stream finished by then (its groups are admitted as it goes), all failed
    with pytest.raises(RunError, match=r"step 0: (\d+) of \1 samples failed .*reward 'hang_plain'"):
        train(p)
    per_group = {group: rewards.calls.groups.count(group) for group in set(rewards.calls.groups)}
    assert max(per_group.values()) <= HUNG_AFTER
    assert len(per_group) <= 2 * 4  # groups the stream holds before the trainer takes one: (1 + max_staleness) x 4
