"""The ``openenv`` env on the environments of ``openenv_testenvs.py`` (a countdown, an MCP adder): in process
and behind a real OpenEnv server (``create_app`` under uvicorn, ``openenv_serve.py``), through Miles' env
conformance checks; a server that dies or restarts mid-episode, refused connections and bad actions; the
action, observation and reward mappings; and the config checks."""

import asyncio
import json
import re
import time

import pytest

from miles import Action, EnvContext, Sample, SampleStatus, ToolCall
from miles.testing import EnvConformance, free_port
from miles_openenv import OpenEnvEnv, OpenEnvFailure
from openenv_testenvs import AddUp, Countdown

COUNTDOWN = "openenv_testenvs:Countdown"
NUMBER = re.compile(r"(?:from|say) (\d+)")


def count_call(said: str) -> str:
    return '<tool_call>{"name": "count_action", "arguments": {"said": "%s"}}</tool_call>' % said


def next_number(observation: str) -> str:
    found = NUMBER.search(observation)
    assert found, f"no number to say in {observation!r}"
    return found.group(1)


class CountdownPolicy:
    """Says every number right, one tool call a turn: three steps, reward 1.0."""

    min_steps = 3

    def act(self, turn: int, observation: str) -> str:
        return count_call(next_number(observation))

    def expected_reward(self, index: int) -> float:
        return 1.0


class TestInProcess(CountdownPolicy, EnvConformance):
    def make_env(self, ctx):
        return OpenEnvEnv(ctx, env=COUNTDOWN)

    def leftovers(self):
        return [f"{Countdown.live} Countdown instances not closed"] if Countdown.live else []


class TestInProcessTextActions(EnvConformance):
    min_steps = 3

    def make_env(self, ctx):
        return OpenEnvEnv(ctx, env=COUNTDOWN, action="text", observation_field="message")

    def act(self, turn, observation):
        return next_number(observation)

    def expected_reward(self, index):
        return 1.0


def wait_for_no_sessions(server, safety_net_s: float = 60.0) -> list[str]:
    """[] once the server has closed every environment (it does so when a session's socket has closed, which
    may be just after the client's close returned); what is left when the safety net runs out."""
    deadline = time.monotonic() + safety_net_s
    while (live := server.live()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [f"{live} environments still open on {server.url}"] if live else []


class TestOnServer(CountdownPolicy, EnvConformance):
    @pytest.fixture(autouse=True)
    def _server(self, countdown_server):
        self.server = countdown_server

    def make_env(self, ctx):
        return OpenEnvEnv(ctx, base_url=self.server.url, observation_field="message")

    def leftovers(self):
        return wait_for_no_sessions(self.server)


def mcp_call(name: str, arguments: dict) -> str:
    return "<tool_call>%s</tool_call>" % json.dumps({"name": name, "arguments": arguments})


class AddUpPolicy:
    """add(2, 3), add(<its answer>, 4), answer(<its answer>): three MCP tool calls, reward 1.0."""

    min_steps = 3

    def act(self, turn, observation):
        if turn == 1:
            return mcp_call("add", {"a": 2, "b": 3})
        total = int(re.search(r"\d+", observation).group())  # the tool's answer
        return mcp_call("add", {"a": total, "b": 4}) if turn == 2 else mcp_call("answer", {"total": total})

    def expected_reward(self, index):
        return 1.0


class TestMcpInProcess(AddUpPolicy, EnvConformance):
    def make_env(self, ctx):
        return OpenEnvEnv(ctx, env="openenv_testenvs:AddUp", action="mcp")

    def leftovers(self):
        return [f"{AddUp.live} AddUp instances not closed"] if AddUp.live else []


class TestMcpOnServer(AddUpPolicy, EnvConformance):
    @pytest.fixture(autouse=True)
    def _server(self, add_up_server):
        self.server = add_up_server

    def make_env(self, ctx):
        return OpenEnvEnv(ctx, base_url=self.server.url, action="mcp")

    def leftovers(self):
        return wait_for_no_sessions(self.server)


def test_mcp_tools_are_offered_as_they_are_listed(add_up_server):
    local = OpenEnvEnv(EnvContext(), env="openenv_testenvs:AddUp", action="mcp")
    remote = OpenEnvEnv(EnvContext(), base_url=add_up_server.url, action="mcp")
    first, (result,) = asyncio.run(episode(local, Action("", [ToolCall("add", {"a": 2, "b": "x"}, id="c")])))
    asyncio.run(episode(remote))
    assert [t["function"]["name"] for t in local.tools] == ["add", "answer"]
    assert local.tools[0]["function"]["parameters"]["required"] == ["a", "b"]
    assert json.dumps(remote.tools, sort_keys=True) == json.dumps(local.tools, sort_keys=True)
    assert first == [{"role": "user", "content": '{"message": "add up 2, 3 and 4", "step": 0}'}]
    # a call the tool rejects comes back as the tool's error, and the episode goes on
    assert result.observation[0]["content"].startswith("error: ") and not result.done
    assert wait_for_no_sessions(add_up_server) == []


class _DoomedServer(CountdownPolicy, EnvConformance):
    """Episode 0 runs on ``doomed``, which is killed as its policy takes turn 2; the others run on ``healthy``."""

    def __init__(self, healthy, doomed):
        self.healthy, self.doomed, self.made = healthy, doomed, 0

    def make_env(self, ctx):
        server = self.doomed if self.made == 0 else self.healthy
        self.made += 1
        return OpenEnvEnv(ctx, base_url=server.url, observation_field="message")

    def act(self, turn, observation):
        if turn == 2 and "doomed: " in observation:  # the tool response, as the chat template renders it
            self.doomed.kill()
        return super().act(turn, observation)


def test_a_server_that_dies_mid_episode_fails_only_that_sample(start_server, countdown_server, chat_model_dir):
    doomed = start_server(env_args={"label": "doomed: "})
    harness = _DoomedServer(countdown_server, doomed)
    harness.set_up_harness(chat_model_dir)
    samples, envs = harness.run_episodes(4)
    assert samples[0].status is SampleStatus.FAILED
    assert samples[0].reason.startswith(f"rollout: OpenEnvFailure: openenv server {doomed.url}: step 2 (action "
                                        "{'said': '2'}) failed: "), samples[0].reason
    for sample in samples[1:]:
        assert sample.status is SampleStatus.COMPLETED and sample.metadata["env_reward"] == 1.0, sample.reason
    assert [env.closes for env in envs] == [1] * 4
    assert wait_for_no_sessions(countdown_server) == []


def sample(data: dict | None = None, prompt="the prompt") -> Sample:
    return Sample(prompt=prompt, prompt_ids=[0], metadata={"data": data or {}, "trajectory": "t0"})


def calls(*said: str | int) -> Action:
    return Action("", [ToolCall("count_action", {"said": s}, id=f"call_{i}") for i, s in enumerate(said)])


async def episode(env: OpenEnvEnv, *turns: Action, data: dict | None = None) -> tuple[list, list]:
    """Reset, the turns, close: the first messages and the step results."""
    try:
        first = await env.reset(sample(data))
        return first, [await env.step(turn) for turn in turns]
    finally:
        await env.close()


def test_a_restarted_server_is_not_taken_for_the_same_session(start_server):
    """After the server restarted on its port, the episode fails: a new connection would be a fresh
    environment on the server, mid-episode."""
    server = start_server()

    async def main():
        env = OpenEnvEnv(EnvContext(), base_url=server.url, observation_field="message")
        try:
            await env.reset(sample())
            await env.step(calls("3"))
            await asyncio.to_thread(server.kill)
            restarted = await asyncio.to_thread(start_server, port=server.port)
            with pytest.raises(OpenEnvFailure, match=f"openenv server {server.url}: step 2 .* failed: ConnectionError: "
                                                     "the server closed this episode's WebSocket session"):
                await env.step(calls("2"))
            return restarted
        finally:
            await env.close()

    restarted = asyncio.run(main())
    assert restarted.live() == 0, "no session was opened on the restarted server"


def test_a_refused_connection_names_the_server():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(OpenEnvFailure, match=f"openenv server {url}: cannot read the action schema "
                                             r"\(GET /schema\): ConnectError"):
        asyncio.run(episode(OpenEnvEnv(EnvContext(), base_url=url)))
    known_action = OpenEnvEnv(EnvContext(), base_url=url, action_class="openenv_testenvs:CountAction")
    with pytest.raises(OpenEnvFailure, match=f"openenv server {url}: connecting failed: ConnectionError: "
                                             f"Failed to connect to ws://127.0.0.1:{url.rsplit(':', 1)[1]}/ws"):
        asyncio.run(episode(known_action))


def test_a_bad_action_fails_naming_the_environment(countdown_server):
    with pytest.raises(OpenEnvFailure, match=r"openenv env openenv_testenvs:Countdown: the action \{'said': 3\} is "
                                             "not a valid CountAction: 1 validation error"):
        asyncio.run(episode(OpenEnvEnv(EnvContext(), env=COUNTDOWN), calls(3)))
    remote = OpenEnvEnv(EnvContext(), base_url=countdown_server.url)
    with pytest.raises(OpenEnvFailure, match=rf"openenv server {countdown_server.url}: step 1 \(action "
                                             r"\{'said': 3\}\) failed: RuntimeError: Server error: Invalid message "
                                             r"\(code: VALIDATION_ERROR\)"):
        asyncio.run(episode(remote, calls(3)))
    assert wait_for_no_sessions(countdown_server) == []


def test_an_environment_error_fails_naming_the_step():
    env = OpenEnvEnv(EnvContext(), env=COUNTDOWN, env_args={"start": 1}, action="text")
    first, results = asyncio.run(episode(env, Action("1")))
    assert results[0].done and results[0].reward == 1.0
    env = OpenEnvEnv(EnvContext(), env=COUNTDOWN, env_args={"start": 1}, action="text")

    async def step_past_the_end():
        try:
            await env.reset(sample())
            await env.step(Action("1"))
            await env.step(Action("0"))
        finally:
            await env.close()

    with pytest.raises(OpenEnvFailure, match=r"openenv env openenv_testenvs:Countdown: step 2 "
                                             r"\(action \{'said': '0'\}\) "
                                             "failed: ValueError: the countdown is over; reset first"):
        asyncio.run(step_past_the_end())
    assert Countdown.live == 0


def test_the_action_tool_and_observation_rendering():
    env = OpenEnvEnv(EnvContext(), env=COUNTDOWN)
    first, (one, two, three) = asyncio.run(episode(env, calls("3"), calls("2"), calls("1")))
    assert first == [{"role": "user", "content": '{"message": "count down from 3", "step": 0}'}]
    assert env.tools == [{"type": "function", "function": {
        "name": "count_action", "description": "Say the next number of the countdown.",
        "parameters": {"additionalProperties": False, "type": "object", "required": ["said"], "properties": {
            "said": {"description": "the number you say", "title": "Said", "type": "string"}}}}}]
    assert one.observation == [{"role": "tool", "name": "count_action", "tool_call_id": "call_0",
                                "content": '{"message": "say 2", "step": 1}'}]
    assert (one.reward, one.done, one.info["openenv"]) == (None, False, [{"reward": None, "done": False,
                                                                          "metadata": {"right": 1, "start": 3}}])
    assert (three.observation, three.reward, three.done) == (None, 1.0, True)


def test_several_calls_in_a_turn_are_steps_in_order_until_done():
    env = OpenEnvEnv(EnvContext(), env=COUNTDOWN, tool_name="say")
    _, (result,) = asyncio.run(episode(env, Action("", [ToolCall("say", {"said": s}, id=s) for s in "3210"])))
    assert (result.done, result.reward, len(result.info["openenv"])) == (True, 1.0, 3)  # "0" was not stepped


def test_a_turn_without_the_tool_is_told_so_and_takes_no_step():
    env = OpenEnvEnv(EnvContext(), env=COUNTDOWN)
    _, (result,) = asyncio.run(episode(env, Action("3")))
    assert result == type(result)(observation="error: no action taken; act by calling the tool count_action")
    assert env.session.steps == 0


def test_reset_takes_data_fields_and_the_prompt_goes_first():
    env = OpenEnvEnv(EnvContext(), env=COUNTDOWN, reset_fields={"start": "n"}, observation_field="message",
                     system_prompt="Count.", include_prompt=True)
    first, _ = asyncio.run(episode(env, data={"n": 2}))
    assert first == [{"role": "system", "content": "Count."},
                     {"role": "user", "content": "the prompt\n\ncount down from 2"}]
    missing = OpenEnvEnv(EnvContext(), env=COUNTDOWN, reset_fields=["start"])
    with pytest.raises(OpenEnvFailure, match="reset_fields: the sample's data has no field 'start' .*; its fields: n"):
        asyncio.run(episode(missing, data={"n": 2}))
    unknown = OpenEnvEnv(EnvContext(), env=COUNTDOWN, observation_field="words")
    with pytest.raises(OpenEnvFailure, match="observation_field 'words': the observation has no such field; it has "
                                             "message, step"):
        asyncio.run(episode(unknown))


@pytest.mark.parametrize("env_args, reward_from, reward_mode, expected", [
    ({}, "auto", "last", 2 / 3),                                          # the observation's reward
    ({"rubric": "unapplied"}, "auto", "last", 2 / 3),                     # no reward in it: the rubric's
    ({"rubric": "unapplied"}, "observation", "last", None),
    ({"rubric": "shadowed", "floor": 0.5}, "auto", "last", 0.5 + 0.5 * 2 / 3),  # the observation's wins
    ({"rubric": "shadowed", "floor": 0.5}, "rubric", "last", 2 / 3),
    ({"rubric": "unapplied"}, "auto", "sum", 1 / 3 + 2 / 3 + 2 / 3),      # the rubric scores every step
])
def test_rewards_from_the_observation_or_the_rubric(env_args, reward_from, reward_mode, expected):
    env = OpenEnvEnv(EnvContext(), env=COUNTDOWN, env_args=env_args, reward_from=reward_from, reward_mode=reward_mode)
    _, results = asyncio.run(episode(env, calls("3"), calls("2"), calls("7")))
    rewards = [r.reward for r in results if r.reward is not None]
    assert (rewards[-1] if rewards else None) == (pytest.approx(expected) if expected is not None else None)


def test_reward_from_rubric_needs_a_rubric():
    env = OpenEnvEnv(EnvContext(), env=COUNTDOWN, reward_from="rubric")
    with pytest.raises(OpenEnvFailure, match="reward_from is 'rubric' but the environment has no rubric"):
        asyncio.run(episode(env))


@pytest.mark.parametrize("args, message", [
    ({}, "env, base_url: set exactly one"),
    ({"env": COUNTDOWN, "base_url": "http://127.0.0.1:1"}, "env, base_url: set exactly one"),
    ({"env": "openenv_testenvs.Countdown"}, "env: expected an import path 'package.module:MyEnvironment'"),
    ({"env": "openenv_testenvs:Nothing"}, "env: cannot import 'openenv_testenvs:Nothing': AttributeError"),
    ({"env": "openenv_testenvs:CountAction"}, "env: 'openenv_testenvs:CountAction' is not an OpenEnv Environment"),
    ({"env": COUNTDOWN, "env_args": {"begin": 3}}, "env_args: openenv_testenvs:Countdown cannot be made with"),
    ({"base_url": "127.0.0.1:8000"}, "base_url: expected the server's URL, starting with one of http://"),
    ({"base_url": "http://h:1", "env_args": {"start": 3}}, "env_args: only for an environment run in process"),
    ({"base_url": "http://h:1", "reward_from": "rubric"}, "reward_from: 'rubric' needs the environment in process"),
    ({"env": COUNTDOWN, "action": "speech"}, "action: expected one of tool, text, mcp, got 'speech'"),
    ({"env": COUNTDOWN, "action": "text", "action_field": "shout"}, "action_field: CountAction has no field 'shout'"),
    ({"env": COUNTDOWN, "action": "text", "action_class": "openenv.core.env_server.mcp_types:CallToolAction"},
     r"action_field: CallToolAction has 3 fields \(type, tool_name, arguments\); name the one"),
    ({"env": COUNTDOWN, "tool_name": "say", "action": "text"}, "tool_name: only with action: tool"),
    ({"env": COUNTDOWN, "reset_args": {"level": 2}},
     r"reset_args, reset_fields: .*reset\(\) takes no argument 'level'"),
    ({"env": COUNTDOWN, "reset_fields": "start"}, "reset_fields: expected a list of data fields"),
    ({"base_url": "http://h:1", "message_timeout_s": 0}, "message_timeout_s: expected a positive number of seconds"),
    ({"env": COUNTDOWN, "action": "mcp"}, "action: 'mcp' needs an MCP environment"),
    ({"base_url": "http://h:1", "action": "mcp", "action_class": "openenv_testenvs:CountAction"},
     "action_class: not with action: mcp"),
])
def test_config_errors_name_the_argument(args, message):
    with pytest.raises(ValueError, match=message):
        OpenEnvEnv.check_args(args)


def test_an_environment_without_an_annotated_action_needs_action_class(monkeypatch):
    import openenv_testenvs

    class Unannotated(Countdown):
        def step(self, action, timeout_s=None, **kwargs):
            return super().step(action)

    monkeypatch.setattr(openenv_testenvs, "Unannotated", Unannotated, raising=False)
    with pytest.raises(ValueError, match=r"action_class: cannot tell which Action class Unannotated.step\(\) takes"):
        OpenEnvEnv.check_args({"env": "openenv_testenvs:Unannotated"})
    OpenEnvEnv.check_args({"env": "openenv_testenvs:Unannotated", "action_class": "openenv_testenvs:CountAction"})


def test_the_server_schema_gives_the_same_tool_as_the_class(countdown_server):
    local, remote = OpenEnvEnv(EnvContext(), env=COUNTDOWN), OpenEnvEnv(EnvContext(), base_url=countdown_server.url)
    asyncio.run(episode(local))
    asyncio.run(episode(remote))
    assert json.dumps(remote.tools, sort_keys=True) == json.dumps(local.tools, sort_keys=True)
    assert wait_for_no_sessions(countdown_server) == []
