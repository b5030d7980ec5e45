"""The session server (OpenAI chat completions over recorded tokens) and the ``agent`` rollout function, driven
by the real ``openai`` client against servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import types
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import openai
import pytest
import torch
import yaml
from openai import AsyncOpenAI

from miles.agentic.chat import Conversation
from miles.agentic.tool_calls import HermesParser
from miles.engine.local import LocalEngine
from miles.errors import ConfigError
from miles.rollout.context import RolloutContext
from miles.session import SessionServer
from miles.testing import build_chat_model, make_registry
from miles.types import Sample, SampleStatus, TrainBatch

from test_docs import code_blocks

DOCS = Path(__file__).resolve().parent.parent / "docs" / "sessions.md"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    # A context of 2048 tokens: the char tokenizer spends one token per character of the tools' system prompt.
    return build_chat_model(tmp_path_factory.mktemp("session-model") / "model", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def engine(model_dir) -> LocalEngine:
    engine = LocalEngine(seed=0)
    engine.load_model(str(model_dir))
    yield engine
    engine.close()


class ScriptedTurnsEngine:
    """A test stand-in for an engine: the next generations answer with the given token ids (None: the real engine
    generates), cut at ``max_new_tokens``, with the real model's log-probs of those ids; a turn that does not end
    with a stop token finishes with ``length``. The random tiny model never writes a tool call by itself, and
    stops by chance."""

    def __init__(self, engine: LocalEngine, turns: list[list[int] | None]) -> None:
        self.engine, self.turns, self.context_length = engine, list(turns), engine.context_length

    async def generate(self, input_ids, sampling_params, return_logprob=True):
        ids = self.turns.pop(0) if self.turns else None
        if ids is None:
            return await self.engine.generate(input_ids, sampling_params, return_logprob)
        ids = ids[: sampling_params["max_new_tokens"]]
        scored = await self.engine.generate(input_ids + ids, {"max_new_tokens": 1}, logprob_start_len=len(input_ids))
        meta = scored["meta_info"]
        stopped = ids[-1] in sampling_params.get("stop_token_ids", ())
        return {"output_ids": ids, "text": "", "meta_info": {
            "output_token_logprobs": meta["input_token_logprobs"], "weight_version": meta["weight_version"],
            "finish_reason": {"type": "stop" if stopped else "length"}}}


class GatedEngine:
    """A test stand-in for an engine: each generation reports that it started and waits for ``release``."""

    def __init__(self, engine: LocalEngine) -> None:
        self.engine, self.context_length = engine, engine.context_length
        self.started: asyncio.Queue = asyncio.Queue()
        self.release = asyncio.Event()

    async def generate(self, input_ids, sampling_params, return_logprob=True):
        self.started.put_nowait(len(input_ids))
        await self.release.wait()
        return await self.engine.generate(input_ids, sampling_params, return_logprob)


class AbortingEngine:
    """A test stand-in for an engine that aborts every generation (as when a partial rollout's batch is full)."""

    def __init__(self, engine: LocalEngine) -> None:
        self.engine, self.context_length = engine, engine.context_length

    async def generate(self, input_ids, sampling_params, return_logprob=True):
        return {"output_ids": [], "text": "", "meta_info": {
            "output_token_logprobs": [], "weight_version": 0,
            "finish_reason": {"type": "abort", "message": "batch full"}}}


@asynccontextmanager
async def serving(engine, max_retries=2, **options):
    """A session server on a free port, an HTTP client, and a helper opening sessions with OpenAI clients (which
    retry ``max_retries`` times: the OpenAI client's default)."""
    server = SessionServer(engine, getattr(engine, "engine", engine).tokenizer, HermesParser(), **options)
    url = await server.start()
    async with aiohttp.ClientSession() as http:
        clients = []

        async def open_session(**body):
            async with http.post(f"{url}/sessions", json=body) as resp:
                assert resp.status == 201, await resp.text()
                sid = (await resp.json())["id"]
            clients.append(AsyncOpenAI(base_url=f"{url}/sessions/{sid}/v1", api_key="unused", max_retries=max_retries))
            return sid, clients[-1]

        try:
            yield server, url, http, open_session
        finally:
            for client in clients:
                await client.close()
            await server.stop()


PROMPT_IDS = {"return_prompt_token_ids": True}  # the answer's miles.prompt_token_ids


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def miles(answer) -> dict:
    return answer.model_extra["miles"]


# -- token in, token out ---------------------------------------------------------------------------


def test_a_conversation_with_tools_is_token_exact(engine, model_dir):
    tokenizer = engine.tokenizer
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    bad_call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    scripted = ScriptedTurnsEngine(engine, [encode(tokenizer, f"Let me look.\n{call}\n{bad_call}<|im_end|>")])

    async def conversation():
        async with serving(scripted) as (_, url, http, open_session):
            sid, client = await open_session(metadata={"task": "weather"})
            messages = [{"role": "system", "content": "You are helpful."},
                        {"role": "user", "content": "Weather in Paris?"}]
            first = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=200,
                                                         extra_body=PROMPT_IDS)
            # The pydantic object as it came: content and arguments as the client serialises them.
            messages += [first.choices[0].message,
                         {"role": "tool", "tool_call_id": first.choices[0].message.tool_calls[0].id,
                          "content": "sunny, 21 C"}]
            second = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=8,
                                                          extra_body=PROMPT_IDS)
            messages += [second.choices[0].message.model_dump(),  # with its null fields
                         {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]}]
            third = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=8,
                                                         extra_body=PROMPT_IDS)
            async with http.get(f"{url}/sessions/{sid}") as resp:
                assert resp.status == 200
                return [first, second, third], await resp.json()

    answers, trajectory = asyncio.run(conversation())
    first = answers[0].choices[0]
    assert first.finish_reason == "tool_calls"
    assert first.message.content == "Let me look."
    # every call the model wrote, as a server hands it back (the template renders the turn back as generated); the
    # one the tools refuse is named with its error
    tool_call, unknown = first.message.tool_calls
    assert (tool_call.function.name, json.loads(tool_call.function.arguments)) == ("get_weather", {"city": "Paris"})
    [invalid] = miles(answers[0])["invalid_tool_calls"]
    assert invalid["name"] == unknown.function.name == "get_time" and "unknown tool 'get_time'" in invalid["error"]
    assert (miles(answers[0])["parse_errors"], miles(answers[0])["schema_errors"]) == (0, 1)
    # the random model may write <tool_call> too
    valid = [len(a.choices[0].message.tool_calls or []) - miles(a)["schema_errors"] for a in answers]
    assert trajectory["tool_stats"] == {
        "calls": sum(valid) + sum(len(miles(a)["invalid_tool_calls"]) for a in answers), "succeeded": sum(valid),
        "parse_errors": sum(miles(a)["parse_errors"] for a in answers),
        "schema_errors": sum(miles(a)["schema_errors"] for a in answers), "timeouts": 0}

    # Each prompt is the recorded tokens so far plus the new messages' tokens.
    extras = [miles(a) for a in answers]
    assert trajectory["prompt_ids"] == extras[0]["prompt_token_ids"]
    for before, after in zip(extras, extras[1:]):
        recorded = before["prompt_token_ids"] + before["token_ids"]
        assert after["prompt_token_ids"][: len(recorded)] == recorded
    suffix = extras[1]["prompt_token_ids"][len(extras[0]["prompt_token_ids"]) + len(extras[0]["token_ids"]):]
    assert suffix == encode(tokenizer, "\n<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response>"
                                       "<|im_end|>\n<|im_start|>assistant\n")
    closed = extras[1]["token_ids"][-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    suffix = extras[2]["prompt_token_ids"][len(extras[1]["prompt_token_ids"]) + len(extras[1]["token_ids"]):]
    assert suffix == encode(tokenizer, ("" if closed else "<|im_end|>")
                            + "\n<|im_start|>user\nAnd tomorrow?<|im_end|>\n<|im_start|>assistant\n")
    last = extras[2]["prompt_token_ids"] + extras[2]["token_ids"]
    assert trajectory["prompt_ids"] + trajectory["response_ids"] == last

    # The loss mask marks exactly the generated tokens, which keep the engine's log-probs; the rest have 0.0.
    response, mask, logprobs = trajectory["response_ids"], trajectory["loss_mask"], trajectory["logprobs"]
    assert len(response) == len(mask) == len(logprobs)
    start = len(trajectory["prompt_ids"])
    expected_mask = [0] * len(response)
    for answer, extra in zip(answers, extras):
        at = len(extra["prompt_token_ids"]) - start
        assert response[at: at + len(extra["token_ids"])] == extra["token_ids"]
        assert logprobs[at: at + len(extra["token_ids"])] == extra["logprobs"]
        expected_mask[at: at + len(extra["token_ids"])] = [1] * len(extra["token_ids"])
        assert answer.usage.prompt_tokens == len(extra["prompt_token_ids"])
        assert answer.usage.completion_tokens == len(extra["token_ids"])
    assert mask == expected_mask
    assert all(lp == 0.0 for lp, m in zip(logprobs, mask) if m == 0)
    assert trajectory["weight_versions"] == [0, 0, 0] and trajectory["turns"] == 3
    assert trajectory["metadata"] == {"task": "weather"} and trajectory["status"] == "open"
    assert [m["role"] for m in trajectory["messages"]] == ["system", "user", "assistant", "tool", "assistant", "user",
                                                           "assistant"]

    # The recorded log-probs are the model's over the whole trajectory.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.tensor([trajectory["prompt_ids"] + response])
    with torch.no_grad():
        reference = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
    reference = reference.gather(-1, ids[0, 1:, None]).squeeze(-1)[start - 1:]
    generated = torch.tensor(mask, dtype=torch.bool)
    assert torch.allclose(torch.tensor(logprobs)[generated], reference[generated], atol=1e-4)


def test_a_turn_cut_by_max_tokens_is_closed_by_the_next_prompt(engine):
    tokenizer = engine.tokenizer
    scripted = ScriptedTurnsEngine(engine, [encode(tokenizer, "Hel"), encode(tokenizer, "Bye<|im_end|>")])

    async def conversation():
        async with serving(scripted) as (server, _, _, open_session):
            sid, client = await open_session()
            messages = [{"role": "user", "content": "Hi"}]
            first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=3)
            messages += [first.choices[0].message, {"role": "user", "content": "Go on"}]
            second = await client.chat.completions.create(model="policy", messages=messages)
            return first, second, server.sessions[sid].trajectory()

    first, second, trajectory = asyncio.run(conversation())
    assert first.choices[0].finish_reason == "length" and first.choices[0].message.content == "Hel"
    assert second.choices[0].finish_reason == "stop" and second.choices[0].message.content == "Bye"
    assert trajectory["status"] == "open"
    expected = encode(tokenizer, "Hel<|im_end|>\n<|im_start|>user\nGo on<|im_end|>\n<|im_start|>assistant\n"
                                 "Bye<|im_end|>")
    assert trajectory["response_ids"] == expected
    assert trajectory["loss_mask"] == [1] * 3 + [0] * (len(expected) - 7) + [1] * 4


# -- what a session refuses ------------------------------------------------------------------------


def test_a_rewritten_message_or_changed_tools_get_409_and_leave_the_session_as_it_was(engine):
    async def conversation():
        async with serving(engine) as (server, _, _, open_session):
            sid, client = await open_session()
            messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "weather?"}]
            first = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=4,
                                                         extra_body=PROMPT_IDS)
            messages.append(first.choices[0].message.model_dump())
            messages.append({"role": "user", "content": "and now?"})
            before = json.dumps(server.sessions[sid].trajectory())
            refusals = {}
            rewrites = {
                "user": (1, {"role": "user", "content": "changed"}),
                "assistant": (2, {**messages[2], "content": "I said something else"}),
                "missing": (None, None),
            }
            for name, (index, replacement) in rewrites.items():
                sent = list(messages)
                if index is None:
                    del sent[2]
                else:
                    sent[index] = replacement
                with pytest.raises(openai.ConflictError) as refused:
                    await client.chat.completions.create(model="policy", messages=sent, tools=TOOLS, max_tokens=4)
                refusals[name] = refused.value
            for name, tools in {"tools changed": [{**TOOLS[0], "function": {**TOOLS[0]["function"], "name": "w"}}],
                                "tools left out": openai.omit}.items():
                with pytest.raises(openai.ConflictError) as refused:
                    await client.chat.completions.create(model="policy", messages=messages, tools=tools, max_tokens=4)
                refusals[name] = refused.value
            assert json.dumps(server.sessions[sid].trajectory()) == before
            second = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=4,
                                                          extra_body=PROMPT_IDS)
            return first, second, refusals, server.sessions[sid]

    first, second, refusals, session = asyncio.run(conversation())
    assert refusals["user"].param == "messages[1]" and refusals["user"].code == "history_changed"
    assert 'messages[1] (user) differs from the one this session holds: content "weather?" became "changed"' in str(
        refusals["user"])
    assert refusals["assistant"].param == "messages[2]"
    assert "messages[2] (assistant)" in str(refusals["assistant"]) and "I said something else" in str(
        refusals["assistant"])
    assert refusals["missing"].param == "messages[2]" and "role" in str(refusals["missing"])
    for name in ("tools changed", "tools left out"):
        assert refusals[name].param == "tools" and refusals[name].code == "tools_changed"
    recorded = miles(first)["prompt_token_ids"] + miles(first)["token_ids"]
    if session.tito["splits"]:  # the random model ended its turn otherwise than the template renders it
        part = session.segments[0]
        assert part["prompt_ids"] + part["response_ids"] == recorded
        assert miles(second)["prompt_token_ids"] == session.prompt_ids  # the template's rendering of the history
    else:
        assert miles(second)["prompt_token_ids"][: len(recorded)] == recorded


def test_bad_requests_get_400_naming_the_field_and_unknown_sessions_404(engine):
    async def requests():
        async with serving(engine) as (_, url, http, open_session):
            sid, client = await open_session()
            chat = f"{url}/sessions/{sid}/v1/chat/completions"
            hello = [{"role": "user", "content": "hello"}]
            answers = {}
            bodies = {
                "stream": {"messages": hello, "stream": True}, "n": {"messages": hello, "n": 2},
                "stop": {"messages": hello, "stop": ["x"]}, "frobnicate": {"messages": hello, "frobnicate": 1},
                "tool_choice": {"messages": hello, "tool_choice": "required"}, "messages": {"model": "m"},
                "messages[0].role": {"messages": [{"role": "robot", "content": "beep"}]},
                "max_tokens": {"messages": hello, "max_tokens": 0},
            }
            for name, body in bodies.items():
                async with http.post(chat, json=body) as resp:
                    answers[name] = (resp.status, await resp.json(), resp.headers.get("x-should-retry"))
            async with http.post(chat, data=b'{"messages": [', headers={"Content-Type": "application/json"}) as resp:
                answers["malformed"] = (resp.status, await resp.json(), None)
            with pytest.raises(openai.BadRequestError) as n_two:
                await client.chat.completions.create(model="policy", messages=hello, n=2)
            with pytest.raises(openai.BadRequestError) as top_k:
                await client.chat.completions.create(model="policy", messages=hello, extra_body={"top_k": 5})
            async with http.post(f"{url}/sessions/nope/v1/chat/completions", json={"messages": hello}) as resp:
                answers["unknown chat"] = (resp.status, await resp.json(), None)
            async with http.get(f"{url}/sessions/nope") as resp:
                answers["unknown get"] = (resp.status, await resp.json(), None)
            async with http.post(f"{url}/sessions", json={"metadata": [1]}) as resp:
                answers["metadata"] = (resp.status, await resp.json(), None)
            async with http.delete(f"{url}/sessions/{sid}") as resp:
                answers["delete"] = (resp.status, None, None)
            for method in ("get", "delete"):
                async with http.request(method, f"{url}/sessions/{sid}") as resp:
                    answers[f"{method} deleted"] = (resp.status, await resp.json(), None)
            return answers, n_two.value, top_k.value

    answers, n_two, top_k = asyncio.run(requests())
    for name in ("stream", "n", "stop", "frobnicate", "tool_choice", "messages", "messages[0].role", "max_tokens"):
        status, body, retry = answers[name]
        assert (status, body["error"]["param"], retry) == (400, name, "false"), (name, body)
        assert name.partition("[")[0] in body["error"]["message"]
    assert answers["malformed"][0] == 400 and "not valid JSON" in answers["malformed"][1]["error"]["message"]
    assert n_two.param == "n" and top_k.param == "top_k" and "'top_k'" in str(top_k)
    assert answers["unknown chat"][0] == 404 and "no session 'nope'" in answers["unknown chat"][1]["error"]["message"]
    assert answers["unknown get"] == (404, {"error": "no session 'nope' (deleted, or never opened: POST /sessions)"},
                                      None)
    assert answers["metadata"][0] == 400 and "metadata" in answers["metadata"][1]["error"]
    assert answers["delete"][0] == 204
    assert answers["get deleted"][0] == answers["delete deleted"][0] == 404


def test_completions_of_one_session_run_one_at_a_time_and_sessions_concurrently(engine):
    async def race():
        gated = GatedEngine(engine)
        async with serving(gated) as (_, _, _, open_session):
            (_, one), (_, other) = await open_session(), await open_session()
            hello = [{"role": "user", "content": "hello"}]
            running = asyncio.ensure_future(one.chat.completions.create(model="p", messages=hello, max_tokens=3))
            await gated.started.get()  # the first completion is inside the engine now
            with pytest.raises(openai.ConflictError) as busy:
                await one.chat.completions.create(model="p", messages=hello, max_tokens=3)
            concurrent = asyncio.ensure_future(other.chat.completions.create(model="p", messages=hello, max_tokens=3))
            await gated.started.get()  # the other session's completion is inside the engine too
            gated.release.set()
            return busy.value, await running, await concurrent

    busy, first, other = asyncio.run(race())
    assert busy.code == "session_busy"
    assert first.usage.completion_tokens == len(miles(first)["token_ids"]) >= 1
    assert other.usage.completion_tokens == len(miles(other)["token_ids"]) >= 1


def test_a_prompt_past_the_context_gets_400_naming_both_lengths_and_the_session_goes_on(engine, caplog):
    tokenizer = engine.tokenizer
    hello = [{"role": "user", "content": "hello"}]
    prompt = len(Conversation(tokenizer, hello).prompt_ids)
    context = prompt + 40
    scripted = ScriptedTurnsEngine(engine, [encode(tokenizer, "Hi")])

    async def conversation():
        async with serving(scripted, context_length=context) as (server, url, http, open_session):
            sid, client = await open_session()
            first = await client.chat.completions.create(model="p", messages=hello, max_tokens=2)
            held = json.loads(json.dumps(server.sessions[sid].trajectory()))  # a copy: the session grows later
            refused = {}
            for name, text in {"tokenized": "a long question" * 3, "counted": "x" * 600}.items():
                with pytest.raises(openai.BadRequestError) as too_long:
                    await client.chat.completions.create(
                        model="p", messages=hello + [first.choices[0].message, {"role": "user", "content": text}])
                refused[name] = too_long.value
            async with http.get(f"{url}/sessions/{sid}") as resp:
                after = await resp.json()
            messages = hello + [first.choices[0].message, {"role": "user", "content": "ok"}]
            second = await client.chat.completions.create(model="p", messages=messages, max_tokens=2)
            return first, held, refused, after, second, server.sessions[sid].trajectory()

    first, held, refused, after, second, last = asyncio.run(conversation())
    assert first.choices[0].finish_reason == "length" and held["status"] == "open"
    recorded = len(held["prompt_ids"]) + len(held["response_ids"])
    # "Hi" was cut by max_tokens: the next prompt closes it with <|im_end|>
    suffix = encode(tokenizer, "<|im_end|>\n<|im_start|>user\n" + "a long question" * 3
                    + "<|im_end|>\n<|im_start|>assistant\n")
    for name, size in {"tokenized": f"the prompt is {recorded + len(suffix)} tokens",
                       "counted": f"the prompt is at least {recorded + -(-600 // 16)} tokens (600 characters"}.items():
        error = refused[name]
        assert (error.status_code, error.param, error.code) == (400, "messages", "context_length_exceeded")
        assert size in error.message and f"the context length of {context} tokens" in error.message, error.message
        assert f"this session holds {recorded} tokens so far" in error.message
    # Refused: the session is as it was, and says why its last request was refused.
    assert {k: v for k, v in after.items() if k != "context_exceeded"} == {
        k: v for k, v in held.items() if k != "context_exceeded"}
    assert after["status"] == "open" and after["context_exceeded"] == refused["counted"].body["message"]
    assert second.usage.prompt_tokens == recorded + len(encode(
        tokenizer, "<|im_end|>\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n"))
    assert last["turns"] == 2 and last["context_exceeded"] is None
    logged = [r.getMessage() for r in caplog.records if r.name == "miles.session.server"]
    assert len(logged) == 2 and all("400 context_length_exceeded: messages: the prompt is" in m for m in logged)


def test_a_generation_that_reaches_the_context_length_ends_the_session(engine):
    tokenizer = engine.tokenizer
    hello = [{"role": "user", "content": "hello"}]
    prompt = len(Conversation(tokenizer, hello).prompt_ids)
    scripted = ScriptedTurnsEngine(engine, [encode(tokenizer, "and so on and so forth")])

    async def conversation():
        # Room for the first prompt and 5 generated tokens (the next position must be inside the context).
        async with serving(scripted, context_length=prompt + 6) as (server, _, _, open_session):
            sid, client = await open_session()
            cut = await client.chat.completions.create(model="p", messages=hello, max_tokens=100)
            messages = hello + [cut.choices[0].message, {"role": "user", "content": "go on"}]
            with pytest.raises(openai.ConflictError) as ended:
                await client.chat.completions.create(model="p", messages=messages)
            return cut, ended.value, server.sessions[sid].trajectory()

    cut, ended, trajectory = asyncio.run(conversation())
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.content == "and s"
    assert trajectory["status"] == "truncated" and f"context length ({prompt + 6} tokens)" in trajectory["reason"]
    assert ended.code == "session_ended"


# -- the command line ------------------------------------------------------------------------------


def test_session_serve_answers_a_completion(model_dir, tiny_model_dir, miles_cli):
    proc = subprocess.Popen([sys.executable, "-m", "miles", "session", "serve", "--model", str(model_dir),
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    try:
        line = proc.stdout.readline()  # printed once the server listens
        assert line.startswith("miles sessions serving"), (line, proc.stderr.read() if proc.poll() is not None else "")
        url = line.split(" on ")[1].split()[0]

        async def one_completion():
            async with aiohttp.ClientSession() as http, http.post(f"{url}/sessions") as resp:
                sid = (await resp.json())["id"]
            async with AsyncOpenAI(base_url=f"{url}/sessions/{sid}/v1", api_key="unused") as client:
                return await client.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=4)

        answer = asyncio.run(one_completion())
        assert answer.object == "chat.completion" and answer.usage.completion_tokens == len(miles(answer)["token_ids"])
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + 15 and "Traceback" not in stderr, stderr  # SIGTERM unwinds like Ctrl-C

    bad_model = miles_cli("session", "serve", "--model", str(model_dir.parent / "nope"))
    assert bad_model.returncode == 2 and "is not an HF model directory" in bad_model.stderr
    bad_parser = miles_cli("session", "serve", "--model", str(model_dir), "--tool-parser", "nope")
    assert bad_parser.returncode == 2 and "unknown tool_parser 'nope'" in bad_parser.stderr
    no_template = miles_cli("session", "serve", "--model", str(tiny_model_dir))
    assert no_template.returncode == 2 and "the tokenizer has no chat template" in no_template.stderr
    assert "Traceback" not in bad_model.stderr + bad_parser.stderr + no_template.stderr


# -- the agent rollout function --------------------------------------------------------------------


async def chatty_agent(base_url, sample, turns=2, reward=1.0, max_tokens=None):
    """A test agent: ``turns`` completions, each followed by a user message; it keeps the session's trajectory as
    it saw it in ``sample.metadata["seen"]``."""
    messages = [{"role": "user", "content": str(sample.prompt)}]
    async with AsyncOpenAI(base_url=base_url, api_key="unused") as client:
        for turn in range(turns):
            if turn:
                messages.append({"role": "user", "content": f"go on ({turn})"})
            answer = await client.chat.completions.create(
                model="policy", messages=messages, **({"max_tokens": max_tokens} if max_tokens else {}))
            messages.append(answer.choices[0].message)
    async with aiohttp.ClientSession() as http, http.get(base_url.removesuffix("/v1")) as resp:
        sample.metadata["seen"] = await resp.json()
    return reward


async def failing_agent(base_url, sample, make_completion=True):
    """A test agent that raises after one completion (or without any)."""
    if make_completion:
        async with AsyncOpenAI(base_url=base_url, api_key="unused") as client:
            await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    raise RuntimeError("the sandbox fell over")


async def silent_agent(base_url, sample):
    """A test agent that makes no completion."""
    return 1.0


def agent_fn(agent: str, **args):
    return make_registry().build("rollout_fn", {"name": "agent", "agent": f"{__name__}:{agent}", **args}, "rollout.fn")


def context(engine, max_new_tokens: int = 6) -> RolloutContext:
    return RolloutContext(engine=engine, tokenizer=getattr(engine, "engine", engine).tokenizer,
                          sampling_params={"max_new_tokens": max_new_tokens, "temperature": 1.0},
                          context_length=engine.context_length, tool_parser=HermesParser())


def test_the_agent_rollout_fn_makes_a_trainable_token_exact_sample(engine):
    tokenizer = engine.tokenizer
    scripted = ScriptedTurnsEngine(engine, [None, None, encode(tokenizer, "The answer is 4.<|im_end|>")])
    fn = agent_fn("chatty_agent", turns=3, reward=0.75)
    sample = Sample(prompt_ids=[1, 2], prompt="What is 2+2?", label="4")
    asyncio.run(fn(sample, context(scripted, max_new_tokens=32)))

    assert sample.status is SampleStatus.COMPLETED, sample.reason
    seen = sample.metadata["seen"]
    assert (sample.prompt_ids, sample.response_ids) == (seen["prompt_ids"], seen["response_ids"])
    assert (sample.loss_mask, sample.rollout_logprobs) == (seen["loss_mask"], seen["logprobs"])
    assert sample.weight_versions == seen["weight_versions"] == [0, 0, 0] and sample.turns == 3
    assert tokenizer.decode(sample.prompt_ids) == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert sample.response_text == "The answer is 4."
    assert sample.metadata["env_reward"] == 0.75
    assert sample.metadata["tools"] == {"calls": 0, "succeeded": 0, "parse_errors": 0, "schema_errors": 0,
                                        "timeouts": 0}
    assert fn._servers == {}  # the server stopped with the last sample
    sample.reward = sample.metadata["env_reward"]
    batch = TrainBatch.from_samples([sample], pad_token_id=0)
    assert batch.num_tokens == sum(sample.loss_mask) > 0


def test_the_agent_rollout_fn_shares_one_server_per_event_loop(engine):
    fn = agent_fn("chatty_agent", turns=2, max_tokens=3)
    ctx = context(engine)

    async def step(samples):
        await asyncio.gather(*(fn(s, ctx) for s in samples))
        return fn._servers == {}

    for _ in range(2):  # each step in a fresh event loop, as Miles may run them
        samples = [Sample(prompt_ids=[1], prompt=f"question {i}", index=i) for i in range(3)]
        assert asyncio.run(step(samples))
        for sample in samples:
            assert sample.trainable and sample.turns == 2, sample.reason
            if sample.status is SampleStatus.TRUNCATED:  # unless the random model stopped by itself
                assert sample.reason == "max_tokens reached in the last turn"
            assert sample.response_ids == sample.metadata["seen"]["response_ids"]
            assert sample.metadata["seen"]["metadata"] == {"group_index": 0, "index": sample.index}
        assert len({s.metadata["seen"]["id"] for s in samples}) == 3  # one session each


def test_an_agent_that_fails_or_makes_no_completion_fails_its_sample(engine):
    ctx = context(engine)
    results = {}
    for name, fn in {"raises": agent_fn("failing_agent"), "raises first": agent_fn("failing_agent",
                                                                                  make_completion=False),
                     "silent": agent_fn("silent_agent")}.items():
        sample = Sample(prompt_ids=[1], prompt="hi")
        asyncio.run(fn(sample, ctx))
        results[name] = sample
        assert fn._servers == {}
    for name in ("raises", "raises first"):
        assert results[name].status is SampleStatus.FAILED
        assert results[name].reason == (f"rollout: agent {__name__}:failing_agent raised RuntimeError: "
                                         f"the sandbox fell over")
    assert results["silent"].status is SampleStatus.FAILED
    assert results["silent"].reason == "rollout: the agent made no chat completion"
    assert "env_reward" not in results["silent"].metadata


def test_an_aborted_generation_aborts_the_sample_without_tokens(engine):
    fn = agent_fn("chatty_agent")
    sample = Sample(prompt_ids=[7], prompt="hi")
    asyncio.run(fn(sample, context(AbortingEngine(engine))))
    assert sample.status is SampleStatus.ABORTED
    assert sample.reason == "partial rollout: the engine aborted a generation (batch full)"
    assert (sample.prompt_ids, sample.response_ids) == ([7], [])  # the agent starts over when it is continued
    assert fn._servers == {}


def test_an_agent_that_cannot_be_called_is_a_config_error():
    with pytest.raises(ConfigError, match="cannot import 'no_such_module:solve'"):
        make_registry().build("rollout_fn", {"name": "agent", "agent": "no_such_module:solve"}, "rollout.fn")
    with pytest.raises(ConfigError, match="must be an async function"):
        make_registry().build("rollout_fn", {"name": "agent", "agent": f"{__name__}:agent_fn"}, "rollout.fn")
    with pytest.raises(ConfigError, match="unexpected keyword argument 'colour'"):
        agent_fn("silent_agent", colour="red")
    # Checked when the config is validated, before a run starts.
    from miles.run.runner import prepare

    with pytest.raises(ConfigError, match="rollout_fn 'agent' rejected its arguments: agent: cannot import"):
        prepare(DOCS.parent.parent / "configs" / "quickstart.yaml", ['rollout.fn={name: agent, agent: "nope:solve"}'])


async def picky_agent(base_url, sample, retries=1):
    return 1.0


def _check_picky(args):
    if args.get("retries", 1) < 0:
        raise ValueError(f"retries: expected an integer >= 0, got {args['retries']}")


picky_agent.check_args = _check_picky


def test_an_agent_s_own_check_args_sees_its_arguments_at_validation():
    node = {"name": "agent", "agent": f"{__name__}:picky_agent"}
    make_registry().build("rollout_fn", {**node, "retries": 2}, "rollout.fn")
    with pytest.raises(ConfigError, match="retries: expected an integer >= 0, got -1"):
        make_registry().build("rollout_fn", {**node, "retries": -1}, "rollout.fn")


# -- the guide -------------------------------------------------------------------------------------


def blocks(language: str) -> list[str]:
    return code_blocks(DOCS, language)


def test_the_guide_s_agent_and_config_work(engine, monkeypatch):
    [code] = blocks("python")
    module = types.ModuleType("sessions_guide_example")
    exec(compile(code, f"{DOCS}[python]", "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    [config] = blocks("yaml")
    node = yaml.safe_load(config)["rollout"]["fn"]
    assert node["agent"] == "my_pkg.agents:solve"
    fn = make_registry().build("rollout_fn", {**node, "agent": f"{module.__name__}:solve"}, "rollout.fn")
    scripted = ScriptedTurnsEngine(engine, [
        encode(engine.tokenizer, '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call><|im_end|>'),
        encode(engine.tokenizer, "It is 4.<|im_end|>")])
    sample = Sample(prompt_ids=[1], prompt="What is 2+2?", label="4")
    asyncio.run(fn(sample, context(scripted, max_new_tokens=100)))
    assert sample.status is SampleStatus.COMPLETED, sample.reason
    assert sample.turns == 2 and sample.metadata["env_reward"] == 1.0
    assert sample.metadata["tools"]["succeeded"] == 1
    assert "<tool_response>\n4\n</tool_response>" in engine.tokenizer.decode(sample.response_ids)
