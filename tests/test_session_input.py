"""What clients send the session server that it must survive: clients that disconnect mid-request, messages too
large for the context or the event loop, and malformed requests. Real servers on 127.0.0.1, the real ``openai``
and aiohttp clients; work is held with gates (the engine paused, a tokenizing thread stopped), never timed."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import random
import threading
from pathlib import Path

import openai
import pytest
from openai import AsyncOpenAI

from miles.agentic.chat import Conversation
from miles.engine.local import LocalEngine
from miles.session import SessionServer
from miles.session.openai_api import MAX_DEPTH
from miles.testing import build_chat_model

from miles.testing import make_registry
from miles.types import Sample, SampleStatus

from test_session import PROMPT_IDS, TOOLS, context, miles
from test_session import serving as served

GATE_TIMEOUT_S = 60  # a gate never released fails its request instead of hanging the test
SETTLE_TIMEOUT_S = 60  # how long the server may take to notice a disconnect before the test fails


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_chat_model(tmp_path_factory.mktemp("session-input-model") / "model", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def engine(model_dir) -> LocalEngine:
    """An engine that generates in its own thread, so that a request can wait inside it (paused) while the event
    loop goes on."""
    engine = LocalEngine(seed=0, background=True)
    engine.load_model(str(model_dir))
    yield engine
    engine.close()


class HeldEngine:
    """The real engine, as the session server sees it (``generate`` with ``rid``, ``abort(rid)``), recording each
    request that reaches it and each one the server aborts, with the engine's own answer to it."""

    def __init__(self, engine: LocalEngine) -> None:
        self.engine, self.context_length = engine, engine.context_length
        self.arrived: asyncio.Queue = asyncio.Queue()  # (rid, the engine's answer to come)
        self.aborted: asyncio.Queue = asyncio.Queue()  # rid

    async def generate(self, input_ids, sampling_params, return_logprob=True, rid=None):
        answer = asyncio.ensure_future(self.engine.generate(input_ids, sampling_params, return_logprob, rid=rid))
        self.arrived.put_nowait((rid, answer))
        return await asyncio.shield(answer)  # the test awaits the engine's answer even when the server gave up

    def abort(self, rid):
        count = self.engine.abort(rid)
        self.aborted.put_nowait(rid)
        return count


class TokenizerGate:
    """Stops the thread that tokenizes a text containing a marker until the test releases it (the session server
    tokenizes in worker threads: the event loop must go on meanwhile)."""

    def __init__(self, monkeypatch) -> None:
        self.held: dict[str, tuple[threading.Event, threading.Event]] = {}
        original = Conversation.encode

        def encode(conversation, text):
            for marker, (entered, release) in list(self.held.items()):
                if marker in text:
                    entered.set()
                    if not release.wait(GATE_TIMEOUT_S):
                        raise TimeoutError(f"the tokenizer gate {marker!r} was never released")
            return original(conversation, text)

        monkeypatch.setattr(Conversation, "encode", encode)

    def hold(self, marker: str) -> tuple[threading.Event, threading.Event]:
        """(entered, release) for texts containing ``marker``."""
        self.held[marker] = (threading.Event(), threading.Event())
        return self.held[marker]


async def wait_thread_event(event: threading.Event) -> None:
    assert await asyncio.get_running_loop().run_in_executor(None, event.wait, GATE_TIMEOUT_S), "never reached"


# A session server with OpenAI clients that never retry: a retry would hide what a disconnect left behind.
serving = functools.partial(served, max_retries=0)


def snapshot(server: SessionServer, sid: str) -> str:
    return json.dumps(server.sessions[sid].trajectory())


# -- a client that disconnects (item 7) ------------------------------------------------------------


MOMENTS = ("sending the body", "tokenizing", "in the engine", "answered, unread")


async def _raw_request(url: str, path: str, body: bytes, send: int) -> tuple[asyncio.StreamReader,
                                                                           asyncio.StreamWriter]:
    """A POST over a plain socket that sends the first ``send`` bytes of ``body`` only."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:send])
    await writer.drain()
    return reader, writer


@pytest.mark.parametrize("seed", [0, 1])
def test_a_client_that_disconnects_leaves_the_session_as_it_saw_it_and_its_retry_succeeds(engine, monkeypatch,
                                                                                          seed):
    """At a random moment of each request (seeded), the client goes away. Before its answer was written, the
    generation is aborted in the engine and the session is exactly as before; after, the turn is recorded. Either
    way the client's retry of the same request succeeds, and the session holds one turn for it."""
    rng = random.Random(seed)
    moments = [m for m in MOMENTS for _ in range(3)]
    rng.shuffle(moments)
    gate = TokenizerGate(monkeypatch)
    held = HeldEngine(engine)

    async def rounds():
        async with serving(held) as (server, url, http, open_session):
            sid, client = await open_session()
            session = server.sessions[sid]
            chat = f"/sessions/{sid}/v1/chat/completions"
            messages, seen = [], []
            for i, moment in enumerate(moments):
                marker = f"[round {i}]"
                messages.append({"role": "user", "content": f"{marker} {'question ' * rng.randint(1, 4)}"})
                body = {"model": "p", "messages": messages, "max_tokens": rng.randint(1, 4)}
                before = snapshot(server, sid)
                written = None
                if moment == "sending the body":
                    raw = json.dumps(body).encode()
                    _, writer = await _raw_request(url, chat, raw, rng.randint(0, len(raw) - 1))
                    writer.close()
                elif moment == "answered, unread":
                    raw = json.dumps(body).encode()
                    reader, writer = await _raw_request(url, chat, raw, len(raw))
                    written = await reader.readuntil(b"\r\n\r\n")  # the server has written its answer
                    writer.close()
                    await asyncio.wait_for(session.wait_idle(), SETTLE_TIMEOUT_S)
                else:
                    held.arrived, held.aborted = asyncio.Queue(), asyncio.Queue()  # this request's only
                    if moment == "tokenizing":
                        entered, release = gate.hold(marker)
                    else:
                        engine.pause()
                    request = (client.chat.completions.create(**body) if rng.random() < 0.5
                               else http.post(f"{url}{chat}", json=body))
                    task = asyncio.ensure_future(request)
                    if moment == "tokenizing":
                        await wait_thread_event(entered)
                    else:
                        rid, answer = await held.arrived.get()
                    assert session.busy
                    task.cancel()  # the client goes away: its connection closes
                    await asyncio.gather(task, return_exceptions=True)
                    if moment == "in the engine":
                        assert await asyncio.wait_for(held.aborted.get(), SETTLE_TIMEOUT_S) == rid
                        engine.resume()
                        assert (await answer)["meta_info"]["finish_reason"]["type"] == "abort"
                    await asyncio.wait_for(session.wait_idle(), SETTLE_TIMEOUT_S)
                    if moment == "tokenizing":
                        release.set()
                if written is None:
                    assert snapshot(server, sid) == before, moment  # nothing of the request is recorded
                else:
                    assert written.startswith(b"HTTP/1.1 200") and session.turns == i + 1
                retry = await client.chat.completions.create(**body)
                assert session.turns == i + 1 and miles(retry)["turn"] == i + 1, moment
                messages.append(retry.choices[0].message.model_dump())
                seen.append((moment, retry))
            trajectory = server.sessions[sid].trajectory()
            async with http.get(f"{url}/sessions/{sid}") as resp:
                assert resp.status == 200
            return seen, trajectory

    seen, trajectory = asyncio.run(rounds())
    assert trajectory["turns"] == len(MOMENTS) * 3 and trajectory["status"] == "open"
    assert [m["role"] for m in trajectory["messages"]] == ["user", "assistant"] * len(seen)
    parts = [*trajectory["segments"], trajectory]  # the parts a template that renders otherwise split it into
    generated = [t for part in parts for m, t in zip(part["loss_mask"], part["response_ids"]) if m]
    assert generated == [t for _, answer in seen for t in miles(answer)["token_ids"]]  # each turn once
    assert engine.stats()["waiting_requests"] == engine.stats()["running_requests"] == 0


def test_a_retry_of_the_last_request_gets_its_answer_again_and_nothing_is_recorded_twice(engine):
    async def conversation():
        async with serving(engine) as (server, _, _, open_session):
            sid, client = await open_session()
            messages = [{"role": "user", "content": "hello"}]
            first = await client.chat.completions.create(model="p", messages=messages, max_tokens=3)
            held = snapshot(server, sid)
            again = await client.chat.completions.create(model="p", messages=messages, max_tokens=3)
            after = snapshot(server, sid)
            with pytest.raises(openai.ConflictError) as other:  # not the same request: the history rule holds
                await client.chat.completions.create(model="p", messages=messages, max_tokens=4)
            return first, again, held, after, other.value

    first, again, held, after, other = asyncio.run(conversation())
    assert again.model_dump() == first.model_dump() and after == held
    assert other.code == "history_changed" and other.param == "messages[1]"


# -- one large message must not stall the server (item 8) -------------------------------------------


def test_tokenizing_runs_off_the_event_loop_while_other_clients_are_served(engine, monkeypatch):
    gate = TokenizerGate(monkeypatch)
    entered, release = gate.hold("[held]")

    async def race():
        async with serving(engine) as (server, url, http, open_session):
            (sid, client), (_, other) = await open_session(), await open_session()
            held = asyncio.ensure_future(client.chat.completions.create(
                model="p", messages=[{"role": "user", "content": "[held] " + "a long message " * 100}], max_tokens=2))
            await wait_thread_event(entered)  # a worker thread tokenizes the message now, and stays there
            async with http.post(f"{url}/sessions", json={}) as resp:
                opened = resp.status
            answer = await other.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}],
                                                         max_tokens=2)
            async with http.get(f"{url}/sessions/{sid}") as resp:
                looked = resp.status, (await resp.json())["turns"]
            served_while_held = not held.done()
            release.set()
            return opened, answer, looked, served_while_held, await held

    opened, answer, looked, served_while_held, held = asyncio.run(race())
    assert served_while_held and opened == 201 and looked == (200, 0)
    assert answer.usage.completion_tokens >= 1 and held.usage.completion_tokens >= 1


def test_a_prompt_too_long_for_the_context_is_refused_before_it_is_tokenized(engine, monkeypatch):
    """4 MiB against a 2048-token context: a 400 naming both lengths, without tokenizing the message (the gate on the
    tokenizer is never reached), in a first completion and in a later one; the session goes on."""
    gate = TokenizerGate(monkeypatch)
    entered, _ = gate.hold("[huge]")
    huge = "[huge] " + "word " * ((4 << 20) // 5)
    visible = len(huge.replace(" ", ""))
    limit = engine.context_length

    async def conversation():
        async with serving(engine) as (server, url, http, open_session):
            sid, client = await open_session()
            refused = []
            for history in ([], [{"role": "user", "content": "hi"}]):
                if history:
                    answer = await client.chat.completions.create(model="p", messages=history, max_tokens=2)
                    history = history + [answer.choices[0].message.model_dump()]
                async with http.post(f"{url}/sessions/{sid}/v1/chat/completions",
                                     json={"messages": history + [{"role": "user", "content": huge}]}) as resp:
                    refused.append((resp.status, await resp.json(), len(history),
                                    len(server.sessions[sid].prompt_ids) + len(server.sessions[sid].response_ids)))
            return refused, server.sessions[sid].trajectory()

    refused, trajectory = asyncio.run(conversation())
    assert not entered.is_set()  # never tokenized
    for status, body, history, held in refused:
        error = body["error"]
        assert (status, error["param"], error["code"]) == (400, "messages", "context_length_exceeded")
        assert f"the prompt is at least {held + -(-visible // 16)} tokens ({visible} characters" in error["message"]
        assert f"the context length of {limit} tokens" in error["message"]
        assert ("this session holds" in error["message"]) == bool(history)
    assert trajectory["turns"] == 1 and trajectory["status"] == "open"
    assert trajectory["context_exceeded"] == refused[-1][1]["error"]["message"]


def test_the_count_before_tokenizing_leaves_whitespace_out(engine):
    """A template may trim whitespace and a tokenizer drop it, so the count before tokenizing leaves it out: a
    message of many spaces around two letters is tokenized, and refused (this char tokenizer spends a token on each
    space) by its exact length."""
    spaced = " " * 40_000 + "hi" + "\n" * 40_000

    async def conversation():
        async with serving(engine) as (_, _, _, open_session):
            _, client = await open_session()
            with pytest.raises(openai.BadRequestError) as too_long:
                await client.chat.completions.create(model="p", messages=[{"role": "user", "content": spaced}])
        return too_long.value

    too_long = asyncio.run(conversation())
    exact = len(Conversation(engine.tokenizer, [{"role": "user", "content": spaced}]).prompt_ids)
    assert f"the prompt is {exact} tokens, more than the context length of 2048 tokens" in too_long.message


def test_answers_carry_the_prompt_ids_only_when_asked(engine):
    async def conversation():
        async with serving(engine) as (server, _, _, open_session):
            sid, client = await open_session()
            hello = [{"role": "user", "content": "hello"}]
            plain = await client.chat.completions.create(model="p", messages=hello, max_tokens=2)
            asked = await client.chat.completions.create(
                model="p", messages=hello + [plain.choices[0].message, {"role": "user", "content": "more"}],
                max_tokens=2, extra_body=PROMPT_IDS)
            return plain, asked, server.sessions[sid].trajectory()

    plain, asked, trajectory = asyncio.run(conversation())
    assert "prompt_token_ids" not in miles(plain)
    assert miles(asked)["prompt_token_ids"] == (trajectory["prompt_ids"] + trajectory["response_ids"])[
        :asked.usage.prompt_tokens]
    assert len(miles(asked)["prompt_token_ids"]) == asked.usage.prompt_tokens


async def overflowing_agent(base_url, sample, first_too_long=False):
    """A test agent whose next message is too long for the context; it lets the 400 raise."""
    async with AsyncOpenAI(base_url=base_url, api_key="unused") as client:
        messages = [{"role": "user", "content": "x" * 5000 if first_too_long else "hi"}]
        answer = await client.chat.completions.create(model="p", messages=messages, max_tokens=2)
        messages += [answer.choices[0].message, {"role": "user", "content": "y" * 5000}]
        await client.chat.completions.create(model="p", messages=messages)
    return 1.0


def test_an_agent_stopped_by_the_context_length_makes_a_truncated_sample(engine):
    samples = {}
    for first_too_long in (False, True):
        fn = make_registry().build("rollout_fn", {"name": "agent", "agent": f"{__name__}:overflowing_agent",
                                                  "first_too_long": first_too_long}, "rollout.fn")
        sample = Sample(prompt_ids=[1], prompt="hi")
        asyncio.run(fn(sample, context(engine)))
        samples[first_too_long] = sample
    truncated, failed = samples[False], samples[True]
    assert truncated.status is SampleStatus.TRUNCATED and "context length of 2048 tokens" in truncated.reason
    assert truncated.turns == 1 and sum(truncated.loss_mask) == len(truncated.response_ids) >= 1
    assert "env_reward" not in truncated.metadata  # the agent raised: the env reward gives its `truncated` value
    assert failed.status is SampleStatus.FAILED and "context length of 2048 tokens" in failed.reason


# -- malformed input is a 400 naming the field (item 9) ----------------------------------------------


def _base_body() -> dict:
    """A valid request that uses every message field: system, user, an assistant turn with a tool call, its result."""
    return {
        "model": "p", "max_tokens": 2, "tools": json.loads(json.dumps(TOOLS)),
        "messages": [
            {"role": "system", "content": "Be brief.", "name": "rules"},
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}], "name": "ann"},
            {"role": "assistant", "content": None, "refusal": None, "audio": None, "function_call": None,
             "tool_calls": [{"id": "call_1", "type": "function",
                             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
    }


NOT = {"string": "x", "number": 7, "boolean": True, "object": {"a": 1}, "array": [1], "null": None}
# field path -> the JSON types it accepts (a wrong one of every other type is sent)
FIELDS = {
    "messages": ("array",), "messages[1]": ("object",), "messages[1].role": (),
    "messages[1].content": ("string", "null"), "messages[1].content[0]": ("object",),
    "messages[1].name": ("string", "null"), "messages[3].tool_call_id": ("string", "null"),
    "messages[2].refusal": ("string", "null"), "messages[2].audio": ("object", "null"),
    "messages[2].function_call": ("object", "null"), "messages[2].tool_calls": ("array", "null"),
    "messages[2].tool_calls[0]": ("object",), "messages[2].tool_calls[0].id": ("string", "null"),
    "messages[2].tool_calls[0].type": ("null",), "messages[2].tool_calls[0].function": ("object",),
    "messages[2].tool_calls[0].function.name": ("string",),
    "messages[2].tool_calls[0].function.arguments": ("string", "null"),
    "tools": ("array", "null"), "tools[0]": ("object",), "tools[0].type": ("null",), "tools[0].function": ("object",),
    "tools[0].function.name": ("string",), "tools[0].function.description": ("string", "null"),
    "tools[0].function.parameters": ("object", "null"), "max_tokens": ("number", "null"),
    "max_completion_tokens": ("number", "null"), "temperature": ("number", "null"), "top_p": ("number", "null"),
    "logprobs": ("boolean", "null"), "return_prompt_token_ids": ("boolean", "null"), "model": ("string", "null"),
    "user": ("string", "null"), "metadata": ("object", "null"), "store": ("boolean", "null"),
    "service_tier": ("string", "null"), "n": ("null",), "stream": ("boolean", "null"), "top_logprobs": ("null",),
    "frequency_penalty": ("null",), "presence_penalty": ("null",), "parallel_tool_calls": ("boolean", "null"),
}
# Values of an accepted type that are still wrong, and loose equalities (true is not 1)
WRONG_VALUES = {
    "messages": [[]], "messages[1].role": ["robot", "User"], "messages[1].content[0]": [{"type": "image_url"}],
    "messages[2].tool_calls[0].type": ["tool"], "tools[0].type": ["tool"], "max_tokens": [0, -1, 1.5],
    "max_completion_tokens": [0, 2.5], "temperature": [-0.1, 2.5], "top_p": [0, 1.5],
    "tools[0].function.parameters": [{"type": 5}], "n": [True, 2, 1.5], "top_logprobs": [False, 3],
    "frequency_penalty": [False, 0.5], "parallel_tool_calls": [False, 1], "messages[1].tool_calls": [[{}]],
    "messages[2].tool_calls": ["", 0, False, {}], "stream": [True, 0], "logprobs": [0, 1],
}


def _set(body: dict, path: str, value) -> None:
    keys = [int(k) if k.isdigit() else k for k in path.replace("[", ".").replace("]", "").split(".")]
    target = body
    for key in keys[:-1]:
        target = target[key]
    target[keys[-1]] = value


def _cases() -> list[tuple[str, object]]:
    cases = [(path, value) for path, accepted in FIELDS.items() for kind, value in NOT.items() if kind not in accepted]
    cases += [(path, value) for path, values in WRONG_VALUES.items() for value in values]
    return cases


def test_every_field_with_a_wrong_type_gets_400_naming_it_and_never_a_traceback(engine, caplog):
    cases = _cases()
    assert len(cases) > 200  # the whole class, not a few examples

    async def requests():
        async with serving(engine) as (_, url, http, open_session):
            sid, _ = await open_session()
            chat = f"{url}/sessions/{sid}/v1/chat/completions"
            async with http.post(chat, json=_base_body()) as resp:
                assert resp.status == 200, await resp.text()  # the base request is fine
            answers = []
            for value in ("x", 0, False, [], [1]):  # a session's metadata is an object (or null)
                async with http.post(f"{url}/sessions", json={"metadata": value}) as resp:
                    answers.append(("metadata", value, resp.status, {"error": {
                        "param": "metadata", "message": (await resp.json())["error"]}}))
            for path, value in cases:
                body = _base_body()
                _set(body, path, value)
                async with http.post(f"{url}/sessions") as resp:  # a fresh one each: a request wrongly accepted
                    sid = (await resp.json())["id"]                 # would move it on
                async with http.post(f"{url}/sessions/{sid}/v1/chat/completions", json=body) as resp:
                    answers.append((path, value, resp.status, await resp.json()))
            return answers

    with caplog.at_level(logging.ERROR):
        answers = asyncio.run(requests())
    wrong = [(path, value, status, body) for path, value, status, body in answers
             if status != 400 or not (body["error"]["param"] or "").startswith(path)
             or f'{body["error"]["param"]}:' not in body["error"]["message"]]
    assert not wrong, wrong
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # no traceback logged


def test_deep_bodies_get_400_naming_where_and_never_a_traceback(engine, caplog):
    def nested(depth: int) -> str:
        return "[" * depth + "]" * depth

    deep = json.loads(nested(MAX_DEPTH + 1))  # parses, yet deeper than the server accepts
    hello = [{"role": "user", "content": "hi"}]
    chat_bodies = {
        "100,000 levels": (f'{{"messages": [{{"role": "user", "content": {nested(100_000)}}}]}}', None),
        "content": ({"messages": [{"role": "user", "content": deep}]}, "messages[0].content"),
        "extra message field": ({"messages": [{"role": "user", "content": "hi", "x": deep}]}, "messages[0].x"),
        "tool schema": ({"messages": hello, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"a": {"default": deep}}}}}]}, "tools[0]"),
        "ignored metadata": ({"messages": hello, "metadata": {"a": deep}}, "metadata.a"),
        "arguments' JSON": ({"messages": hello + [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": nested(500)}}]},
            {"role": "user", "content": "and?"}]}, "messages[1].tool_calls[0].function.arguments"),
    }

    async def requests():
        async with serving(engine) as (_, url, http, open_session):
            sid, client = await open_session()
            chat = f"{url}/sessions/{sid}/v1/chat/completions"
            answers = {}
            for name, (body, _) in chat_bodies.items():
                data = body if isinstance(body, str) else json.dumps(body)
                async with http.post(chat, data=data, headers={"Content-Type": "application/json"}) as resp:
                    answers[name] = resp.status, (await resp.json())["error"]
            for name, data in {"session metadata, 100,000 levels": f'{{"metadata": {{"a": {nested(100_000)}}}}}',
                               "session metadata": json.dumps({"metadata": {"a": deep}})}.items():
                async with http.post(f"{url}/sessions", data=data,
                                     headers={"Content-Type": "application/json"}) as resp:
                    answers[name] = resp.status, {"message": (await resp.json())["error"], "param": None}
            # a deep-enough schema (well within the limit) is fine
            schema = {"type": "object"}
            for _ in range(10):
                schema = {"type": "object", "properties": {"a": schema}}
            tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
            fine = await client.chat.completions.create(model="p", messages=hello, tools=tools, max_tokens=2)
            return answers, fine

    with caplog.at_level(logging.ERROR):
        answers, fine = asyncio.run(requests())
    for name, (status, error) in answers.items():
        assert status == 400, (name, error)
        assert "nested too deeply" in error["message"], (name, error)
        where = chat_bodies.get(name, (None, None))[1]
        if where is not None:
            assert error["param"].startswith(where) and where in error["message"], (name, error)
    assert fine.usage.completion_tokens >= 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
