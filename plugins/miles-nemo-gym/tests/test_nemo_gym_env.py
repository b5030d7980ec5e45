"""The ``nemo_gym`` env against NeMo Gym's real ``example_session_state_mgmt`` resources server (nemo-gym 0.4.0 in
its venv): Miles' env conformance suite with a scripted policy that uses the server's tools, a server that dies
mid-episode, the tools taken from the server's OpenAPI spec, and the config checks."""

import asyncio
import re

import pytest

from miles import Action, EnvContext, Sample, SampleStatus, ToolCall
from miles.testing import EnvConformance, make_registry
from miles_nemo_gym.env import NemoGymEnv, NemoGymError

from nemo_gym_counter import counter_policy, counter_sample


class TestNemoGymEnv(EnvConformance):
    min_steps = 3

    @pytest.fixture(autouse=True)
    def _counter(self, counter_server, counter_rows):
        self.url, self.rows, self.made = counter_server.url, counter_rows, []
        self.on_turn = None  # a hook of the scripted policy

    def make_env(self, ctx):
        env = NemoGymEnv(ctx, base_url=self.url, label_field="expected_count")
        self.made.append(env)
        return env

    def make_sample(self, index):
        return counter_sample(self.rows, index)

    def act(self, turn, observation):
        if self.on_turn is not None:
            self.on_turn(turn)
        return counter_policy(turn, observation)

    def expected_reward(self, index):
        return 0.0 if index % 4 in (1, 2) else 1.0

    def leftovers(self):
        return [f"env {i}: its HTTP client (and the server's session cookie) is still open"
                for i, env in enumerate(self.made) if env._http is not None]

    def test_a_server_that_dies_mid_episode_fails_only_that_sample(self, start_counter_server):
        doomed = start_counter_server()
        self.url = doomed.url
        self.on_turn = lambda turn: doomed.kill() if turn == 2 else None
        (sample,), (env,) = self.run_episodes(1)
        assert doomed.process.returncode is not None
        assert sample.status is SampleStatus.FAILED
        assert sample.reason.startswith(f"rollout: NemoGymError: POST {doomed.url}/get_counter_value failed: the "
                                        f"resources server is unreachable"), sample.reason
        assert env.steps == 2 and env.closes == 1

    def test_the_verifier_gets_the_episode_as_a_response(self):
        """Everything /verify reads comes from this trajectory: with a wrong answer-turn's counter the reward is 0."""
        async def episode():
            env = NemoGymEnv(EnvContext(), base_url=self.url)
            try:
                await env.reset(counter_sample(self.rows, 0))
                await env.step(Action("", [ToolCall("increment_counter", {"count": 1}, "c0")]))
                return await env.step(Action("I am done."))
            finally:
                await env.close()

        result = asyncio.run(episode())
        assert (result.reward, result.done) == (0.0, True)  # 3 + 1 is not the expected 6


def test_tools_from_the_servers_openapi_spec(counter_server, counter_rows):
    async def tools():
        env = NemoGymEnv(EnvContext(), base_url=counter_server.url, tools="openapi")
        try:
            await env.reset(counter_sample(counter_rows, 0))
            return env.tools
        finally:
            await env.close()

    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in asyncio.run(tools())}
    assert sorted(by_name) == ["get_counter_value", "increment_counter"]
    assert by_name["increment_counter"]["properties"]["count"]["type"] == "integer"
    assert by_name["increment_counter"]["required"] == ["count"]


def test_max_steps_verifies_after_that_many_turns(counter_server, counter_rows):
    async def episode():
        env = NemoGymEnv(EnvContext(), base_url=counter_server.url, max_steps=1)
        try:
            await env.reset(counter_sample(counter_rows, 0))  # 3, expects 6
            return await env.step(Action("", [ToolCall("increment_counter", {"count": 3}, "c0")]))
        finally:
            await env.close()

    result = asyncio.run(episode())
    assert (result.reward, result.done) == (1.0, True)
    assert [r.ok for r in result.info["tool_results"]] == [True]


def test_the_env_is_registered_and_checks_its_arguments():
    registry = make_registry(autoload=True)
    assert registry.get("env", "nemo_gym").obj is NemoGymEnv
    assert registry.check("env", {"name": "nemo_gym", "base_url": "http://127.0.0.1:1"}, "rollout.env") == []
    assert "requires argument 'base_url'" in registry.check("env", {"name": "nemo_gym"}, "rollout.env")[0]
    good = {"base_url": "http://127.0.0.1:8001", "tools": "row", "max_steps": None, "timeout_s": 300.0}
    NemoGymEnv.check_args(good)
    for bad, named in [({"base_url": "127.0.0.1:8001"}, "base_url"), ({"tools": "server"}, "tools"),
                       ({"tools": [{"type": "web_search"}]}, "tools[0]"), ({"max_steps": 0}, "max_steps"),
                       ({"timeout_s": -1}, "timeout_s"), ({"label_field": ""}, "label_field")]:
        with pytest.raises(ValueError, match=re.escape(named)):
            NemoGymEnv.check_args({**good, **bad})


def test_a_sample_without_a_task_fails_with_the_reason():
    async def reset():
        env = NemoGymEnv(EnvContext(), base_url="http://127.0.0.1:1")
        try:
            await env.reset(Sample(prompt={"tools": []}, prompt_ids=[0], metadata={"data": {}}))
        finally:
            await env.close()

    with pytest.raises(ValueError, match="responses_create_params has no 'input'"):
        asyncio.run(reset())


def test_an_unreachable_server_fails_at_reset():
    async def reset():
        env = NemoGymEnv(EnvContext(), base_url="http://127.0.0.1:9", timeout_s=10)  # the discard port: nobody
        try:
            await env.reset(Sample(prompt="hi", prompt_ids=[0], metadata={"data": {}}))
        finally:
            await env.close()

    with pytest.raises(NemoGymError, match=r"POST http://127\.0\.0\.1:9/seed_session failed"):
        asyncio.run(reset())
