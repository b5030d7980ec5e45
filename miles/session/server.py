"""The session server: an OpenAI-compatible chat endpoint per trajectory that records the exact tokens behind
it, so that an agent harness written against the OpenAI client produces trainable, token-exact samples.

    miles session serve --model DIR [--host 127.0.0.1] [--port 30001] [--tool-parser hermes]

Endpoints: ``POST /sessions`` (``{"metadata": {...}}``, optional) opens a session, ``POST
/sessions/{id}/v1/chat/completions`` continues it, ``GET /sessions/{id}`` returns its trajectory and
``DELETE /sessions/{id}`` forgets it. Token in, token out: the first completion's prompt is the chat
template's rendering of its messages; every later prompt is the session's tokens so far plus the template's
suffix for the new messages (:class:`~miles.agentic.chat.Conversation`), so the tokens a session records are
a prefix of its next prompt. A request must therefore repeat the session's messages unchanged (409 names
the first one that changed) and keep its ``tools``. Generated tokens keep the engine's log-probs and weight
version (loss mask 1); the new messages' tokens have loss mask 0 and log-prob 0.0.

When a prompt leaves no room in the context for one generated token, the answer finishes with ``length``
and no tokens, and the session's trajectory ends there (status ``truncated``; later completions get 409);
the same when a generation stops at the context length. A completion cut by ``max_tokens`` leaves the
session open: the next prompt closes that turn with the end-of-turn token (loss mask 0), as the chat
template renders it.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from miles.agentic.chat import Conversation, NotAppendOnly
from miles.agentic.turns import turn_source
from miles.engine.http_guard import LOOPBACK, POLICY, Policy, Refused, error_answer, guard, json_answer, json_body
from miles.agentic.metrics import TOOL_STATS
from miles.session.openai_api import (
    ApiError, ChatRequest, assistant_turn, completion_answer, first_difference, parse_chat_request,
)

__all__ = ["Session", "SessionServer", "serve"]


@dataclass
class Session:
    """One trajectory: the messages so far and the tokens behind them (``response_ids`` holds every token after
    the first prompt; ``loss_mask`` is 1 on generated tokens, ``logprobs`` 0.0 elsewhere)."""

    id: str
    metadata: dict[str, Any] = field(default_factory=dict)
    conversation: Conversation | None = None  # set by the first completion; holds the messages (normalised)
    tools: list[dict[str, Any]] | None = None
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)  # one per completion
    turns: int = 0
    status: str = "open"  # "truncated": the context is full; "aborted": the engine aborted a generation (ended)
    reason: str = ""
    finish_reason: str | None = None  # of the last completion
    last_text: str = ""  # the last completion's text (special tokens removed)
    turn_closed: bool = True  # the last completion ended with the end-of-turn token
    tool_stats: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TOOL_STATS, 0))
    busy: bool = False  # a completion is running

    @property
    def messages(self) -> list[dict[str, Any]]:
        return self.conversation.messages if self.conversation is not None else []

    def trajectory(self) -> dict[str, Any]:
        """What ``GET /sessions/{id}`` answers."""
        return {"id": self.id, "metadata": self.metadata, "status": self.status, "reason": self.reason,
                "finish_reason": self.finish_reason, "turns": self.turns, "prompt_ids": self.prompt_ids,
                "response_ids": self.response_ids, "loss_mask": self.loss_mask, "logprobs": self.logprobs,
                "weight_versions": self.weight_versions, "messages": self.messages, "tools": self.tools,
                "tool_stats": self.tool_stats}

    def _append(self, ids: list[int], logprobs: list[float] | None, from_policy: bool) -> None:
        self.response_ids += ids
        self.loss_mask += [int(from_policy)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)


class SessionServer:
    """Serves sessions on ``engine`` (``async generate(input_ids, sampling_params, return_logprob)`` answering
    in SGLang's shape). ``sampling_params`` are the defaults of every generation (a request's ``temperature``
    and ``top_p`` replace them; its ``max_tokens`` can lower ``max_new_tokens``, never raise it);
    ``context_length`` defaults to the engine's."""

    def __init__(self, engine: Any, tokenizer: Any, tool_parser: Any, sampling_params: dict[str, Any] | None = None,
                 context_length: int | None = None, *, allowed_hosts: tuple[str, ...] = (),
                 chat_format: Any = None) -> None:
        # chat_format: the run's BoundFormat (template, its kwargs, stop ids); None: the builtin format the tokenizer
        # speaks, with its own template
        self.chat_format = chat_format
        if chat_format is None and getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template; the session server renders messages with one "
                             "(set model.tokenizer.chat_template, e.g. chatml_tools, for a built tokenizer)")
        self.engine, self.tokenizer, self.tool_parser = engine, tokenizer, tool_parser
        self.sampling_params = dict(sampling_params or {})
        self.context_length = context_length or getattr(engine, "context_length", None)
        self.sessions: dict[str, Session] = {}
        self.app = web.Application(middlewares=[guard])
        self.app[POLICY] = Policy(allowed_hosts=frozenset(h.lower() for h in allowed_hosts))
        self.app.router.add_post("/sessions", self._create)
        self.app.router.add_get("/sessions/{id}", self._get)
        self.app.router.add_delete("/sessions/{id}", self._delete)
        self.app.router.add_post("/sessions/{id}/v1/chat/completions", self._chat)
        self._runner: web.AppRunner | None = None

    # -- lifecycle and sessions ---------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on ``host:port`` (0: a free port); returns the base URL, e.g. ``http://127.0.0.1:40123``."""
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = self._runner.addresses[-1][1]  # what port 0 became
        return f"http://{f'[{host}]' if ':' in host else host}:{bound}"

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    def open(self, metadata: dict[str, Any] | None = None) -> Session:
        """A new session (what ``POST /sessions`` does, for in-process callers)."""
        session = Session(uuid.uuid4().hex, dict(metadata or {}))
        self.sessions[session.id] = session
        return session

    # -- completions --------------------------------------------------------------------------------

    async def complete(self, session: Session, body: dict[str, Any]) -> dict[str, Any]:
        """One chat completion on ``session``; an :class:`ApiError` says why it was refused (the session is then
        unchanged)."""
        request = parse_chat_request(body)
        if session.busy:
            raise ApiError(409, "another completion of this session is running; a session's completions run one "
                                "at a time (its next prompt needs the previous answer)", code="session_busy")
        if session.status != "open":
            raise ApiError(409, f"this session's trajectory has ended ({session.reason}); open a new session",
                           code="session_ended")
        session.busy = True
        held, turns = len(session.messages), session.turns
        try:
            return await self._complete(session, request)
        finally:
            session.busy = False
            if session.turns == turns and session.conversation is not None:
                del session.conversation.messages[held:]  # no turn recorded: neither are the new messages

    async def _complete(self, session: Session, request: ChatRequest) -> dict[str, Any]:
        first = session.conversation is None
        new_ids, conversation = self._new_tokens(session, request)
        prompt = new_ids if first else session.prompt_ids + session.response_ids + new_ids
        room = self.context_length - 1 - len(prompt) if self.context_length else None
        cap = int(self.sampling_params.get("max_new_tokens", 0)) or room or 128
        budget = min(x for x in (cap, request.max_tokens, room) if x is not None)
        if budget < 1:
            return self._overflow(session, request, prompt)
        params = {**self.sampling_params, "max_new_tokens": budget,
                  "stop_token_ids": conversation.format.request_stop_ids(
                      self.sampling_params.get("stop_token_ids", ()))}
        params.update({k: v for k, v in (("temperature", request.temperature), ("top_p", request.top_p))
                       if v is not None})
        try:
            answer = await self.engine.generate(prompt, params, return_logprob=True)
        except ValueError as exc:
            raise ApiError(400, f"the engine refused the request: {exc}") from exc
        meta = answer["meta_info"]
        finish = meta["finish_reason"]["type"]
        if finish == "abort":  # e.g. a partial rollout's batch is full: this trajectory stops here
            session.status = "aborted"
            session.reason = f"the engine aborted a generation ({meta['finish_reason'].get('message') or 'abort'})"
            raise ApiError(503, f"{session.reason}; this session's trajectory ends (its last turn is not recorded)",
                           code="engine_aborted")
        ids = list(answer["output_ids"])
        logprobs = [float(t[0]) for t in meta["output_token_logprobs"]]
        text = turn_source(conversation.format, ids)
        turn = session.turns + 1
        message, checked = assistant_turn(text, self.tool_parser, request.tools, f"call_{turn}_")

        # Commit: from here on the session holds this turn.
        if first:
            session.conversation, session.tools, session.prompt_ids = conversation, request.tools, list(new_ids)
        else:
            session._append(new_ids, None, from_policy=False)
        session._append(ids, logprobs, from_policy=True)
        # one per completion; a completion that a weight update landed in (in_place) adds each version
        versions = [int(v) for v in meta.get("output_token_weight_versions") or [meta["weight_version"]]]
        session.weight_versions += [v for i, v in enumerate(versions) if i == 0 or v != versions[i - 1]]
        session.turns, session.last_text = turn, self.tokenizer.decode(ids, skip_special_tokens=True)
        session.turn_closed = bool(ids) and ids[-1] == conversation.eot_id
        conversation.add_policy_turn(message)
        stats = session.tool_stats
        stats["calls"] += len(checked.calls)
        stats["succeeded"] += len(checked.valid)
        stats["parse_errors"] += checked.parse_errors
        stats["schema_errors"] += checked.schema_errors
        finish_reason = "length" if finish == "length" else "tool_calls" if checked.valid else "stop"
        session.finish_reason = finish_reason
        if finish == "length" and room is not None and budget == room:
            session.status, session.reason = "truncated", f"the context length ({self.context_length} tokens) reached"
        invalid = [{"id": c.id, "name": c.name, "arguments": c.arguments, "error": c.error}
                   for c in checked.calls if c.error is not None]
        extra = {"session_id": session.id, "turn": turn, "prompt_token_ids": prompt, "token_ids": ids,
                 "logprobs": logprobs, "weight_version": int(meta["weight_version"]), "invalid_tool_calls": invalid,
                 "parse_errors": checked.parse_errors, "schema_errors": checked.schema_errors}
        return completion_answer(
            completion_id=f"chatcmpl-{session.id}-{turn}", model=request.model, message=message,
            finish_reason=finish_reason, prompt_tokens=len(prompt), completion_tokens=len(ids),
            logprobs=self._openai_logprobs(ids, logprobs) if request.logprobs else None, extra=extra)

    def _new_tokens(self, session: Session, request: ChatRequest) -> tuple[list[int], Conversation]:
        """The tokens this request adds (the whole prompt on the first completion), and the conversation that
        holds its messages (appended to the session's; the caller removes them if the completion fails)."""
        try:
            if session.conversation is None:
                conversation = Conversation(self.chat_format or self.tokenizer, request.messages, request.tools)
                return list(conversation.prompt_ids), conversation
            conversation = session.conversation
            if request.tools != session.tools:
                raise ApiError(409, "tools: a session's tools cannot change (they are rendered into its first "
                                    "prompt); send the same tools as its first completion, or open a new session",
                               param="tools", code="tools_changed")
            difference = first_difference(conversation.messages, request.messages)
            if difference is not None:
                index, why = difference
                raise ApiError(409, f"{why}. A session's earlier messages cannot change: their tokens are recorded "
                                    f"(open a new session for another history)",
                               param=f"messages[{index}]", code="history_changed")
            new = request.messages[len(conversation.messages):]
            if not new:
                raise ApiError(400, f"messages: nothing new after the {len(conversation.messages)} messages this "
                                    f"session holds; add the next user or tool message(s)", param="messages")
            ids = conversation.extend(new)
        except NotAppendOnly as exc:
            raise ApiError(400, str(exc), param="messages", code="template_not_append_only") from exc
        except ApiError:
            raise
        except Exception as exc:  # the chat template refused the messages (e.g. a system message not first)
            raise ApiError(400, f"messages: the chat template cannot render them: {type(exc).__name__}: {exc}",
                           param="messages") from exc
        if not session.turn_closed:  # the last turn was cut (max_tokens): close it as the template renders it
            ids = [conversation.eot_id] + ids
        return ids, conversation

    def _overflow(self, session: Session, request: ChatRequest, prompt: list[int]) -> dict[str, Any]:
        """The answer when the prompt leaves no room for a generated token: ``length``, nothing generated, and
        the trajectory ends (its tokens stay as they were)."""
        if session.conversation is not None:
            session.finish_reason = "length"
        session.status = "truncated"
        session.reason = (f"the context length ({self.context_length} tokens) reached by the prompt of completion "
                          f"{session.turns + 1} ({len(prompt)} tokens)")
        extra = {"session_id": session.id, "turn": None, "prompt_token_ids": prompt, "token_ids": [], "logprobs": [],
                 "weight_version": None, "invalid_tool_calls": [], "parse_errors": 0, "schema_errors": 0,
                 "reason": session.reason}
        return completion_answer(completion_id=f"chatcmpl-{session.id}-overflow", model=request.model,
                                 message={"role": "assistant", "content": ""}, finish_reason="length",
                                 prompt_tokens=len(prompt), completion_tokens=0, logprobs=None, extra=extra)

    def _openai_logprobs(self, ids: list[int], logprobs: list[float]) -> dict[str, Any]:
        texts = self.tokenizer.batch_decode([[i] for i in ids])
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                            for t, lp in zip(texts, logprobs)], "refusal": None}

    # -- HTTP ---------------------------------------------------------------------------------------

    def _session(self, request: web.Request) -> Session:
        session = self.sessions.get(request.match_info["id"])
        if session is None:
            raise Refused(404, f"no session {request.match_info['id']!r} (deleted, or never opened: POST /sessions)")
        return session

    async def _create(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        unknown = sorted(set(body) - {"metadata"})
        if unknown:
            return error_answer(400, f"unknown field(s) {', '.join(map(repr, unknown))}; expected only 'metadata'")
        metadata = body.get("metadata") or {}
        if not isinstance(metadata, dict):
            return error_answer(400, "metadata: expected a JSON object")
        session = self.open(metadata)
        return json_answer({"id": session.id, "metadata": session.metadata}, status=201)

    async def _get(self, request: web.Request) -> web.Response:
        return json_answer(self._session(request).trajectory())

    async def _delete(self, request: web.Request) -> web.Response:
        self.sessions.pop(self._session(request).id)
        return web.Response(status=204)

    async def _chat(self, request: web.Request) -> web.Response:
        try:
            session = self.sessions.get(request.match_info["id"])
            if session is None:
                raise ApiError(404, f"no session {request.match_info['id']!r} (deleted, or never opened: "
                                    f"POST /sessions)", code="session_not_found")
            try:
                body = await json_body(request)
            except Refused as exc:
                raise ApiError(exc.status, str(exc)) from exc
            return json_answer(await self.complete(session, body))
        except Exception as exc:
            if not isinstance(exc, ApiError):  # a bug: logged with its traceback, answered like any refusal
                logging.getLogger(__name__).exception("chat completion of session %s failed", session.id)
                exc = ApiError(500, f"internal error: {type(exc).__name__}: {exc}")
            answer = json_answer(exc.body(), status=exc.status)
            answer.headers["x-should-retry"] = "false"  # the OpenAI client retries 409 and 5xx answers otherwise
            return answer


def serve(model: str, host: str = "127.0.0.1", port: int = 30001, tool_parser: Any = None, seed: int = 0) -> None:
    """Serve sessions on an in-process engine of ``model`` until interrupted; prints the URL once it listens."""
    from miles.engine.local import LocalEngine

    if host not in LOOPBACK:
        print(f"miles: warning: --host {host}: the session server has no authentication; anyone who reaches it "
              f"can generate and read trajectories", file=sys.stderr)
    engine = LocalEngine(seed=seed, background=True)
    try:
        engine.load_model(model)
        # The name it was started with is a Host the guard accepts (e.g. --host node7.cluster).
        allowed = () if host in LOOPBACK | {"0.0.0.0", "::", ""} else (host,)
        server = SessionServer(engine, engine.tokenizer, tool_parser, allowed_hosts=allowed)

        async def run() -> None:
            url = await server.start(host, port)
            print(f"miles sessions serving {model} on {url} (POST {url}/sessions)", flush=True)
            try:
                await asyncio.Event().wait()
            finally:
                await server.stop()

        asyncio.run(run())
    finally:
        engine.close()
