"""miles.testing.EnvConformance run on envs defined here: one that needs several steps, one that runs its
steps in the trajectory's local sandbox, and envs that break the contract, which the harness must catch."""

import functools
import json
import os
import signal

import pytest

from miles import StepResult
from miles.agentic.sandboxes.local import LocalSandbox
from miles.testing import EnvConformance


class Countdown:
    """Say the numbers from the sample's start down to 1, one per turn; reward: the fraction said right."""

    def __init__(self, ctx, start=3):
        self.start, self.said, self.tools = start, [], []

    async def reset(self, sample):
        return f"count down from {self.start}"

    async def step(self, action):
        self.said.append(action.text.strip())
        expected = [str(n) for n in range(self.start, 0, -1)]
        if len(self.said) < self.start:
            return StepResult(observation="next", reward=None)
        return StepResult(reward=sum(a == b for a, b in zip(self.said, expected)) / self.start, done=True)

    async def close(self):
        pass


class FileCounter:
    """Each turn's ``append`` call adds a line to a file in the sandbox; done after three lines; reward:
    the line count the sandbox reports / 3."""

    tools = [{"type": "function", "function": {"name": "append", "description": "append a line",
                                               "parameters": {"type": "object",
                                                              "properties": {"line": {"type": "string"}},
                                                              "required": ["line"]}}}]

    def __init__(self, ctx):
        self.ctx = ctx

    async def reset(self, sample):
        return "append three lines"

    async def step(self, action):
        for call in action.tool_calls:
            await self.ctx.sandbox.run(f"echo {json.dumps(call.arguments['line'])} >> lines.txt", timeout_s=30)
        count = int((await self.ctx.sandbox.run("wc -l < lines.txt", timeout_s=30)).stdout.strip() or 0)
        if count >= 3:
            return StepResult(reward=count / 3, done=True)
        return StepResult(observation=f"{count} lines")

    async def close(self):
        pass


class TestCountdown(EnvConformance):
    min_steps = 3

    def make_env(self, ctx):
        return Countdown(ctx)

    def act(self, turn, observation):
        return str(4 - turn)

    def expected_reward(self, index):
        return 1.0


class TestSandboxedEnv(EnvConformance):
    min_steps = 3

    def make_env(self, ctx):
        return FileCounter(ctx)

    def act(self, turn, observation):
        return '<tool_call>{"name": "append", "arguments": {"line": "x"}}</tool_call>'

    def sandbox_factory(self):
        return functools.partial(LocalSandbox, isolation="subprocess")

    def expected_reward(self, index):
        return 1.0


class NeverDone(Countdown):
    async def step(self, action):
        return StepResult(observation="again")


class LeaksAProcess(Countdown):
    async def reset(self, sample):
        import subprocess

        subprocess.Popen(["sleep", "600"])  # never waited for, never killed
        return await super().reset(sample)


@pytest.mark.parametrize("broken, check, message", [
    (NeverDone, "test_an_episode_runs_to_done_with_a_reward", "truncated"),
    (LeaksAProcess, "test_nothing_is_left_running", "outlived its episode"),
])
def test_the_harness_catches_an_env_that_breaks_the_contract(broken, check, message, chat_model_dir):
    class Broken(TestCountdown):
        def make_env(self, ctx):
            return broken(ctx)

    case = Broken()
    case.set_up_harness(chat_model_dir)
    before = EnvConformance._children()  # other tests' servers may be children too
    with pytest.raises(AssertionError, match=message):
        getattr(case, check)()
    for pid in EnvConformance._children() - before:  # the leaked sleep
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_an_env_knows_the_rollout_s_turn_limit(chat_model_dir):
    seen = []

    class Recording(TestCountdown):
        max_turns = 5

        def make_env(self, ctx):
            seen.append(ctx.max_turns)
            return Countdown(ctx)

    case = Recording()
    case.set_up_harness(chat_model_dir)
    case.run_episodes(2)
    assert seen == [5, 5]
