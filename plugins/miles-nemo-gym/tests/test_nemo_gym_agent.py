"""NeMo Gym's own ``simple_agent`` server (nemo-gym 0.4.0 in its venv) driven against a Miles session server: its
model server is the plugin's Responses adapter, its resources server the real counter server. The session server
generates with a scripted engine stand-in (the tiny chat model's tokenizer, log-probs made up per token), so the
episode uses the tools and the reward is known; what is checked is the protocol: the tokens Miles records, the
tokens the Responses carry, and the reward /run answers."""

import asyncio
import json

import aiohttp
import pytest
from transformers import AutoTokenizer

from miles import Sample
from miles.session import SessionServer
from miles.testing import ScriptedPolicy, free_port, make_registry
from miles_nemo_gym.adapter import SESSION_KEY, ResponsesAdapter
from miles_nemo_gym.agent import check_args, run
from miles_nemo_gym.env import NemoGymError
from miles_nemo_gym.servers import GymServer

from nemo_gym_counter import counter_policy, counter_sample


class LoggedPolicy(ScriptedPolicy):
    """The scripted policy with a distinct log-prob for every generated token, so that they can be traced."""

    async def generate(self, input_ids, sampling_params, return_logprob=True):
        answer = await super().generate(input_ids, sampling_params, return_logprob)
        answer["meta_info"]["output_token_logprobs"] = [[-(self.calls + i / 1000), t, None]
                                                        for i, (_, t, _) in enumerate(answer["meta_info"]
                                                                                      ["output_token_logprobs"])]
        return answer


@pytest.fixture(scope="module")
def agent(gym_python, counter_server, tmp_path_factory):
    """simple_agent with the counter server, and a free port for its model server (the adapter)."""
    port = free_port()
    refs = {"resources_server": counter_server.url, "model_server": f"http://127.0.0.1:{port}"}
    with GymServer.start("responses_api_agents/simple_agent", python=gym_python, refs=refs, config={"max_steps": 6},
                         workdir=tmp_path_factory.mktemp("agent")) as server:
        yield server.url, port


@pytest.fixture(scope="module")
def tokenizer(chat_model_dir):
    return AutoTokenizer.from_pretrained(str(chat_model_dir))


async def serve_sessions(tokenizer):
    parser = make_registry().build("tool_parser", {"name": "hermes"}, "rollout.tool_parser")
    server = SessionServer(LoggedPolicy(tokenizer, counter_policy), tokenizer, parser, {"max_new_tokens": 256})
    return server, await server.start("127.0.0.1", 0)


def test_run_rewards_and_records_each_sample_through_its_session(agent, tokenizer, counter_rows):
    agent_url, port = agent

    async def main():
        server, url = await serve_sessions(tokenizer)
        try:
            sessions = [server.open() for _ in range(4)]
            samples = [counter_sample(counter_rows, i) for i in range(4)]
            rewards = await asyncio.gather(*(
                run(f"{url}/sessions/{s.id}/v1", sample, agent_url=agent_url, adapter_port=port,
                    label_field="expected_count") for s, sample in zip(sessions, samples)))
            return rewards, sessions, samples
        finally:
            await server.stop()

    rewards, sessions, samples = asyncio.run(main())
    assert rewards == [1.0, 0.0, 0.0, 1.0]  # episodes 1 and 2 expect a wrong count
    for session, sample in zip(sessions, samples):
        assert (session.status, session.turns, session.finish_reason) == ("open", 3, "stop")
        assert session.tool_stats["calls"] == session.tool_stats["succeeded"] == 3
        assert session.loss_mask.count(1) > 0 and session.loss_mask.count(0) > 0
        assert session.tito["mismatches"] == 0  # one trajectory: the template renders the history as it was held
        assert session.last_text.startswith("The count is ")
        assert "reward" not in sample.metadata["nemo_gym"]
    assert json.loads(sessions[0].messages[-2]["content"]) == {"count": 6}  # the counter, by this session's cookie


def test_responses_carry_the_sessions_tokens(agent, tokenizer, counter_rows):
    """/run's Response, the way NeMo Gym's vLLM model server returns it: each turn's last item holds the prompt
    and generated token ids and log-probs, and they are exactly what the Miles session recorded."""
    agent_url, port = agent

    async def main():
        server, url = await serve_sessions(tokenizer)
        adapter = ResponsesAdapter()
        await adapter.start("127.0.0.1", port)
        try:
            session = server.open()
            key = adapter.register(f"{url}/sessions/{session.id}/v1")
            row = dict(counter_rows[0])
            row["responses_create_params"] = {**row["responses_create_params"], "metadata": {SESSION_KEY: key}}
            async with aiohttp.ClientSession() as http, http.post(f"{agent_url}/run", json=row) as answer:
                assert answer.status == 200, await answer.text()
                return session, await answer.json()
        finally:
            await adapter.stop()
            await server.stop()

    session, verdict = asyncio.run(main())
    assert verdict["reward"] == 1.0
    turns = [item for item in verdict["response"]["output"] if "generation_token_ids" in item]
    assert [item["type"] for item in turns] == ["function_call", "function_call", "message"]
    assert turns[0]["prompt_token_ids"] == session.prompt_ids
    generated = [i for i, m in zip(session.response_ids, session.loss_mask) if m == 1]
    logprobs = [lp for lp, m in zip(session.logprobs, session.loss_mask) if m == 1]
    assert sum((item["generation_token_ids"] for item in turns), []) == generated
    assert sum((item["generation_log_probs"] for item in turns), []) == logprobs
    for before, after in zip(turns, turns[1:]):  # every prompt extends the one before with its generated tokens
        assert after["prompt_token_ids"][:len(before["prompt_token_ids"])] == before["prompt_token_ids"]
    everything = session.prompt_ids + session.response_ids
    last = turns[-1]
    assert last["prompt_token_ids"] + last["generation_token_ids"] == everything


def test_an_unregistered_session_is_refused_by_the_adapter():
    async def main():
        adapter = ResponsesAdapter()
        url = await adapter.start("127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as http, http.post(f"{url}/v1/responses", json={
                    "input": "hi", "metadata": {SESSION_KEY: "nobody"}}) as answer:
                return answer.status, await answer.json()
        finally:
            await adapter.stop()

    status, body = asyncio.run(main())
    assert status == 400 and "'nobody' is not a session of this adapter" in body["error"]["message"]


def test_an_unreachable_agent_server_fails_the_sample():
    sample = Sample(prompt="add 1 then add 2 then get the count", prompt_ids=[0], metadata={"data": {}})
    with pytest.raises(NemoGymError, match=r"POST http://127\.0\.0\.1:9/run failed: the agent server is unreachable"):
        asyncio.run(run("http://127.0.0.1:1/sessions/x/v1", sample, agent_url="http://127.0.0.1:9",
                        adapter_port=free_port()))


def test_agent_arguments_are_checked_at_start():
    entry = make_registry().get("rollout_fn", "agent")
    entry.obj.check_args({"agent": "miles_nemo_gym.agent:run", "agent_url": "http://127.0.0.1:8002",
                          "adapter_port": 8003})
    with pytest.raises(ValueError, match="adapter_port"):
        entry.obj.check_args({"agent": "miles_nemo_gym.agent:run", "agent_url": "http://127.0.0.1:8002"})
    for bad, named in [({"agent_url": "localhost"}, "agent_url"), ({"adapter_port": 0}, "adapter_port"),
                       ({"timeout_s": 0}, "timeout_s")]:
        with pytest.raises(ValueError, match=named):
            check_args({"agent_url": "http://127.0.0.1:8002", "adapter_port": 8003, **bad})
