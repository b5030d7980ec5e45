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

A vision-language model's messages may hold OpenAI image parts (``{"type": "image_url", "image_url": {"url":
"data:image/png;base64,..."}}``; a path or bare base64 too, never a web URL): each is read, widened to its tokens
and sent to the engine with every later prompt of the session (``image_data``); a bad image is a 400 naming the
message and image, images for a text-only model a 400 saying so.

A prompt that leaves no room in the context for one generated token is refused (400
``context_length_exceeded``, naming both lengths; the session stays as it was), before it is tokenized when
its characters alone prove it; a generation that stops at the context length ends the session's trajectory
(status ``truncated``; later completions get 409). A completion cut by ``max_tokens`` leaves the session open:
the next prompt closes that turn with the end-of-turn token (loss mask 0), as the chat template renders it.

One client cannot stall the others: a request is checked and tokenized in a worker thread while the event loop
serves everyone else. A turn is recorded once its answer is written to the client: a client that disconnects
before (its generation is aborted in the engine) leaves the session as it last saw it, and the exact repeat of
the last request (a retry whose answer was lost on the way) gets that answer again, recorded once.
"""

from __future__ import annotations

import asyncio
import ctypes
import inspect
import json
import logging
import os
import re
import sys
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from miles.agentic.chat import Conversation, NotAppendOnly
from miles.agentic.turns import turn_source
from miles.agentic.types import Message
from miles.engine.http_guard import LOOPBACK, POLICY, Policy, Refused, error_answer, guard, json_answer, json_body
from miles.models.images import ImageProblem, content_text
from miles.types import SampledWith
from miles.models.vision import ImageEncoder
from miles.session.state import Session, running
from miles.session.openai_api import (
    ApiError, ChatRequest, assistant_turn, check_depth, completion_answer, first_difference, parse_chat_request,
)

__all__ = ["Session", "SessionServer", "serve"]

WHITESPACE = re.compile(r"\s")
LARGE_PROMPT_TOKENS = 1 << 16  # a refused prompt this long has its memory given back at once (see _trim_heap)


@dataclass
class _Prompt:
    """A request checked and tokenized (in a worker thread); nothing of it is in the session yet."""

    request: ChatRequest
    conversation: Conversation  # a new one, or a copy of the session's: its messages with the new ones
    new_ids: list[int]  # the tokens this request adds (the whole prompt on the first completion)
    ids: list[int]  # the whole prompt
    # the template rendered the history otherwise than the session's tokens (on_mismatch split or retokenize): the
    # session's tokens to keep before new_ids (None: all of them; split: none, new_ids is the rendered history)
    keep: int | None = None
    mismatch: str = ""


class _ContextExceeded(ApiError):
    def __init__(self, message: str) -> None:
        super().__init__(400, message, param="messages", code="context_length_exceeded")


class SessionServer:
    """Serves sessions on ``engine`` (``async generate(input_ids, sampling_params, return_logprob)`` answering
    in SGLang's shape; with ``rid=`` and an ``abort(rid)``, a request whose client disconnects is aborted there).
    ``sampling_params`` are the defaults of every generation (a request's ``temperature`` and ``top_p`` replace
    them; its ``max_tokens`` can lower ``max_new_tokens``, never raise it); ``context_length`` defaults to the
    engine's; ``images``: a vision-language model's image encoder (None: messages may hold no images).
    ``on_mismatch`` (``rollout.tito.on_mismatch``, resolved): when the template renders the history otherwise than
    the session's tokens, ``fail`` refuses the request (400 ``template_not_append_only``), ``split`` goes on from the
    rendering as a new part of the trajectory, ``retokenize`` re-renders from the first differing token (left out of
    the loss)."""

    def __init__(self, engine: Any, tokenizer: Any, tool_parser: Any, sampling_params: dict[str, Any] | None = None,
                 context_length: int | None = None, *, allowed_hosts: tuple[str, ...] = (),
                 chat_format: Any = None, images: ImageEncoder | None = None, on_mismatch: str = "split") -> None:
        # chat_format: the run's BoundFormat (template, its kwargs, stop ids); None: the builtin format the tokenizer
        # speaks, with its own template
        self.chat_format, self.on_mismatch = chat_format, on_mismatch
        if chat_format is None and getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template; the session server renders messages with one "
                             "(set model.tokenizer.chat_template, e.g. chatml_tools, for a built tokenizer)")
        self.engine, self.tokenizer, self.tool_parser, self.images = engine, tokenizer, tool_parser, images
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
        self._workers: ThreadPoolExecutor | None = None  # checks and tokenizes requests (see _off_loop)
        self._abort = _named_abort(engine)
        self._longest_token: int | None = None  # characters; computed on first use

    # -- lifecycle and sessions ---------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on ``host:port`` (0: a free port); returns the base URL, e.g. ``http://127.0.0.1:40123``."""
        # handler_cancellation: a client that disconnects cancels its request's handler (and so its generation)
        self._runner = web.AppRunner(self.app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = self._runner.addresses[-1][1]  # what port 0 became
        return f"http://{f'[{host}]' if ':' in host else host}:{bound}"

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        workers, self._workers = self._workers, None
        if workers is not None:
            workers.shutdown(wait=False, cancel_futures=True)

    def open(self, metadata: dict[str, Any] | None = None) -> Session:
        """A new session (what ``POST /sessions`` does, for in-process callers)."""
        session = Session(uuid.uuid4().hex, dict(metadata or {}))
        self.sessions[session.id] = session
        return session

    # -- completions --------------------------------------------------------------------------------

    async def complete(self, session: Session, body: dict[str, Any]) -> dict[str, Any]:
        """One chat completion on ``session``, recorded at once; an :class:`ApiError` says why it was refused (the
        session is then unchanged)."""
        with running(session):
            answer, commit = await self._answer(session, body)
            commit()
            return answer

    async def _answer(self, session: Session, body: dict[str, Any]) -> tuple[dict[str, Any], Callable[[], None]]:
        """The answer to ``body`` and the function that records its turn in the session (the caller calls it once
        the answer is delivered). Nothing is recorded before: a cancelled request leaves the session as it was."""
        try:
            prompt = await self._off_loop(self._prepare, session, body)
        except _ContextExceeded as exc:
            session.context_exceeded = str(exc)
            logging.getLogger(__name__).warning("session %s: 400 context_length_exceeded: %s", session.id, exc)
            raise
        if isinstance(prompt, dict):  # the repeat of the last request: its answer again, recorded already
            return prompt, lambda: None
        first = session.conversation is None
        room = self.context_length - 1 - len(prompt.ids) if self.context_length else None
        cap = int(self.sampling_params.get("max_new_tokens", 0)) or room or 128
        budget = min(x for x in (cap, prompt.request.max_tokens, room) if x is not None)
        params = {**self.sampling_params, "max_new_tokens": budget,
                  "stop_token_ids": prompt.conversation.format.request_stop_ids(
                      self.sampling_params.get("stop_token_ids", ()))}
        params.update({k: v for k, v in (("temperature", prompt.request.temperature),
                                         ("top_p", prompt.request.top_p)) if v is not None})
        try:
            answer = await self._generate(session, prompt.ids, params, prompt.conversation.images)
        except ValueError as exc:
            raise ApiError(400, f"the engine refused the request: {exc}") from exc
        meta = answer["meta_info"]
        finish = meta["finish_reason"]["type"]
        if finish == "abort":  # e.g. a partial rollout's batch is full: this trajectory stops here
            session.status = "aborted"
            session.reason = f"the engine aborted a generation ({meta['finish_reason'].get('message') or 'abort'})"
            raise ApiError(503, f"{session.reason}; this session's trajectory ends (its last turn is not recorded)",
                           code="engine_aborted")
        request, conversation = prompt.request, prompt.conversation
        ids = list(answer["output_ids"])
        logprobs = [float(t[0]) for t in meta["output_token_logprobs"]]
        text = turn_source(conversation.format, ids)
        turn = session.turns + 1
        message, checked = assistant_turn(text, self.tool_parser, request.tools, f"call_{turn}_")
        finish_reason = "length" if finish == "length" else "tool_calls" if checked.valid else "stop"
        invalid = [{"id": c.id, "name": c.name, "arguments": c.arguments, "error": c.error}
                   for c in checked.calls if c.error is not None]
        extra = {"session_id": session.id, "turn": turn, "token_ids": ids, "logprobs": logprobs,
                 "weight_version": int(meta["weight_version"]), "invalid_tool_calls": invalid,
                 "parse_errors": checked.parse_errors, "schema_errors": checked.schema_errors}
        if request.return_prompt_token_ids:
            extra["prompt_token_ids"] = prompt.ids
        reply = completion_answer(
            completion_id=f"chatcmpl-{session.id}-{turn}", model=request.model, message=message,
            finish_reason=finish_reason, prompt_tokens=len(prompt.ids), completion_tokens=len(ids),
            logprobs=self._openai_logprobs(ids, logprobs) if request.logprobs else None, extra=extra)

        def commit() -> None:
            """From here on the session holds this turn."""
            if prompt.mismatch:  # counted as a multi-turn rollout counts it
                session.tito["mismatches"] += 1
            if first:
                session.tools, session.prompt_ids = request.tools, list(prompt.new_ids)
            elif prompt.keep == 0:  # split: the rendered history is the new part's prompt
                session.tito["splits"] += 1
                session.split(prompt.new_ids)
            else:
                if prompt.keep is not None:  # retokenize: the session's tokens from the first difference go
                    session.tito["retokenized_tokens"] += len(session.prompt_ids) + len(session.response_ids) \
                        - prompt.keep
                    session.truncate(prompt.keep - len(session.prompt_ids))
                session._append(prompt.new_ids, None, from_policy=False)
            SampledWith.add(session.sampled_with, len(session.response_ids), params)
            session._append(ids, logprobs, from_policy=True)
            # one per completion; a completion that a weight update landed in (in_place) adds each version
            versions = [int(v) for v in meta.get("output_token_weight_versions") or [meta["weight_version"]]]
            session.weight_versions += [v for i, v in enumerate(versions) if i == 0 or v != versions[i - 1]]
            session.turns, session.last_text = turn, self.tokenizer.decode(ids, skip_special_tokens=True)
            conversation.add_policy_turn(message, ids, cut=finish == "length")
            session.conversation = conversation
            stats = session.tool_stats
            stats["calls"] += len(checked.calls)
            stats["succeeded"] += len(checked.valid)
            stats["parse_errors"] += checked.parse_errors
            stats["schema_errors"] += checked.schema_errors
            session.finish_reason, session.context_exceeded, session.last = finish_reason, "", (request, reply)
            if finish == "length" and room is not None and budget == room:
                session.status = "truncated"
                session.reason = f"the context length ({self.context_length} tokens) reached"

        return reply, commit

    async def _off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in a worker thread, so that the event loop serves the other clients meanwhile (tokenizing a
        message of megabytes takes seconds; the tokenizer's Rust code runs without the GIL, so a few threads serve
        a few such messages at once). Cancelled, the thread goes on and its result is dropped."""
        if self._workers is None:
            self._workers = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1),
                                               thread_name_prefix="miles-session")
        return await asyncio.get_running_loop().run_in_executor(self._workers, fn, *args)

    async def _generate(self, session: Session, prompt: list[int], params: dict[str, Any],
                        images: list[Any]) -> dict[str, Any]:
        """The engine's answer. When the caller is cancelled (its client disconnected), the engine's request is
        aborted as well, as SGLang aborts the request of a client that disconnects (an engine without ``abort(rid)``
        is left to finish it; its answer is dropped)."""
        extra = {"image_data": [image.ref for image in images]} if images else {}
        if self._abort is None:
            return await self.engine.generate(prompt, params, return_logprob=True, **extra)
        rid = f"session-{session.id}-{session.turns + 1}-{uuid.uuid4().hex[:8]}"
        try:
            return await self.engine.generate(prompt, params, return_logprob=True, rid=rid, **extra)
        except asyncio.CancelledError:
            self._abort(rid)
            raise

    def _prepare(self, session: Session, body: dict[str, Any]) -> _Prompt | dict[str, Any]:
        """The request checked and tokenized, or the last answer when it repeats the last request. Runs in a worker
        thread: it reads the session (which nothing changes while a completion runs) and writes nothing there."""
        request = parse_chat_request(body)
        if session.last is not None and session.last[0] == request:
            return session.last[1]
        if session.status != "open":
            raise ApiError(409, f"this session's trajectory has ended ({session.reason}); open a new session",
                           code="session_ended")
        held = len(session.prompt_ids) + len(session.response_ids)
        if session.conversation is not None:
            self._check_history(session, request)
        new = request.messages[len(session.messages):]
        self._check_length_bound(held, new)
        new_ids, conversation, keep, mismatch = self._new_tokens(session, request)
        recorded = session.prompt_ids + session.response_ids
        ids = new_ids if session.conversation is None or keep == 0 else recorded[:keep] + new_ids
        if self.context_length and len(ids) > self.context_length - 2:
            size = len(ids)
            del ids, new_ids, conversation  # gone before the answer: see _trim_heap
            if size > LARGE_PROMPT_TOKENS:
                _trim_heap()
            raise _ContextExceeded(self._too_long(f"{size} tokens", held))
        return _Prompt(request, conversation, new_ids, ids, keep, mismatch)

    def _check_history(self, session: Session, request: ChatRequest) -> None:
        """409 when the request does not continue the session (changed tools or messages), 400 when it adds none."""
        if request.tools != session.tools:
            raise ApiError(409, "tools: a session's tools cannot change (they are rendered into its first "
                                "prompt); send the same tools as its first completion, or open a new session",
                           param="tools", code="tools_changed")
        difference = first_difference(session.messages, request.messages)
        if difference is not None:
            index, why = difference
            raise ApiError(409, f"{why}. A session's earlier messages cannot change: their tokens are recorded "
                                f"(open a new session for another history)",
                           param=f"messages[{index}]", code="history_changed")
        if len(request.messages) == len(session.messages):
            raise ApiError(400, f"messages: nothing new after the {len(session.messages)} messages this "
                                f"session holds; add the next user or tool message(s)", param="messages")

    def _check_length_bound(self, held: int, new: list[Message]) -> None:
        """Refuse a prompt that cannot fit before tokenizing it (seconds for megabytes). A token stands for at most
        as many characters as the longest entry of the vocabulary, so the new messages' characters give a lower
        bound on their tokens. Counted: the contents of the messages that are not the assistant's (a template may
        leave out an old answer's reasoning), after the tokenizer's normalizer, whitespace left out (a template may
        trim it, a tokenizer drop it)."""
        if not self.context_length:
            return
        room = self.context_length - 2 - held  # tokens the new messages may take
        text = "".join(content_text(m["content"]) for m in new if m["role"] != "assistant")
        longest = self._longest()
        if not longest or len(text) <= room * longest:  # fits, whatever the count: no need to count
            return
        normalizer = getattr(getattr(self._format_tokenizer(), "backend_tokenizer", None), "normalizer", None)
        if normalizer is not None:
            text = normalizer.normalize_str(text)
        chars = len(WHITESPACE.sub("", text))
        if chars > room * longest:
            raise _ContextExceeded(self._too_long(
                f"at least {held + -(-chars // longest)} tokens ({chars} characters besides whitespace in the new "
                f"messages, at most {longest} per token)", held))

    def _too_long(self, size: str, held: int) -> str:
        session = f"; this session holds {held} tokens so far" if held else ""
        return (f"messages: the prompt is {size}, more than the context length of {self.context_length} tokens "
                f"allows (a prompt may have {self.context_length - 2} tokens at most, to leave room for one "
                f"generated token{session}); shorten the new messages or open a new session")

    def _format_tokenizer(self) -> Any:
        return self.chat_format.tokenizer if self.chat_format is not None else self.tokenizer

    def _longest(self) -> int:
        """How many characters the longest vocabulary entry holds (0 when the tokenizer does not tell)."""
        if self._longest_token is None:
            vocab = getattr(self._format_tokenizer(), "get_vocab", None)
            self._longest_token = max(map(len, vocab()), default=0) if callable(vocab) else 0
        return self._longest_token

    def _new_tokens(self, session: Session, request: ChatRequest) -> tuple[list[int], Conversation, int | None, str]:
        """The tokens this request adds (the whole prompt on the first completion), the conversation that holds its
        messages (a new one, or a fork of the session's: the session's own is replaced when the turn is recorded),
        and, when the template renders the history otherwise than the session's tokens (``on_mismatch``), how many
        of the session's tokens stay (0: the rendered history starts a new part) and why."""
        try:
            if session.conversation is None:
                conversation = Conversation(self.chat_format or self.tokenizer, request.messages, request.tools,
                                            images=self.images)
                return list(conversation.prompt_ids), conversation, None, ""
            conversation = session.conversation.fork()
            new = request.messages[len(conversation.messages):]
            try:
                return conversation.extend(new), conversation, None, ""
            except NotAppendOnly as exc:
                if self.on_mismatch == "fail":
                    raise
                return (*session.resynced(conversation, new, self.on_mismatch), str(exc))
        except NotAppendOnly as exc:
            raise ApiError(400, str(exc), param="messages", code="template_not_append_only") from exc
        except ImageProblem as exc:
            raise ApiError(400, f"messages: {exc}", param="messages", code="invalid_image") from exc
        except Exception as exc:  # the chat template refused the messages (e.g. a system message not first)
            raise ApiError(400, f"messages: the chat template cannot render them: {type(exc).__name__}: {exc}",
                           param="messages") from exc

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
        metadata = {} if body.get("metadata") is None else body["metadata"]
        if not isinstance(metadata, dict):
            return error_answer(400, f"metadata: expected a JSON object, got {json.dumps(metadata)[:80]}")
        try:
            check_depth(metadata, "metadata")
        except ApiError as exc:
            return error_answer(400, str(exc))
        session = self.open(metadata)
        return json_answer({"id": session.id, "metadata": session.metadata}, status=201)

    async def _get(self, request: web.Request) -> web.Response:
        return json_answer(self._session(request).trajectory())

    async def _delete(self, request: web.Request) -> web.Response:
        self.sessions.pop(self._session(request).id)
        return web.Response(status=204)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        session = None
        try:
            session = self.sessions.get(request.match_info["id"])
            if session is None:
                raise ApiError(404, f"no session {request.match_info['id']!r} (deleted, or never opened: "
                                    f"POST /sessions)", code="session_not_found")
            try:
                body = await json_body(request)
            except Refused as exc:
                raise ApiError(exc.status, str(exc)) from exc
            except ConnectionError:  # the client went away while its body was read: nobody to answer
                return error_answer(400, "the client closed the connection before its request was read")
            with running(session):
                answer, commit = await self._answer(session, body)
                response = json_answer(answer)
                try:
                    await response.prepare(request)
                    await response.write_eof()
                except ConnectionError:  # the client went away: it never had this answer, so the turn is not
                    return response      # the session's (aiohttp gives up on the response quietly)
                commit()
                return response
        except Exception as exc:
            if not isinstance(exc, ApiError):  # a bug: logged with its traceback, answered like any refusal
                logging.getLogger(__name__).exception("chat completion of session %s failed",
                                                      session.id if session else "?")
                exc = ApiError(500, f"internal error: {type(exc).__name__}: {exc}")
            answer = json_answer(exc.body(), status=exc.status)
            answer.headers["x-should-retry"] = "false"  # the OpenAI client retries 409 and 5xx answers otherwise
            return answer


def _trim_heap() -> None:
    """Give the heap memory freed by a huge prompt back to the system. glibc keeps it for reuse otherwise: after a
    4 MiB message of spaces was tokenized (4 M tokens) and refused, the server held 0.8 GB more that nothing
    referenced."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def _named_abort(engine: Any) -> Callable[[str], Any] | None:
    """``engine.abort`` when it aborts one request by its name and ``engine.generate`` takes one (``rid``, as
    SGLang's do), else None: the router's ``abort()`` ends every request, not one."""
    abort, generate = getattr(engine, "abort", None), getattr(engine, "generate", None)
    if not callable(abort) or inspect.iscoroutinefunction(abort):
        return None
    try:
        takes_name = list(inspect.signature(abort).parameters)[:1] != []
        parameters = inspect.signature(generate).parameters.values()
    except (TypeError, ValueError):
        return None
    takes_rid = any(p.name == "rid" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    return abort if takes_name and takes_rid else None


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
        images = ImageEncoder(engine.vision, engine.image_processor) if engine.vision is not None else None
        server = SessionServer(engine, engine.tokenizer, tool_parser, allowed_hosts=allowed, images=images)

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
