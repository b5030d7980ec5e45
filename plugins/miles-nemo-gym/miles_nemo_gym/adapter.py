"""A NeMo Gym model server in front of Miles sessions: ``POST /v1/responses`` (OpenAI's Responses API, which NeMo
Gym's agents call their model with) translated to a chat completion of a Miles session, and the answer back.

NeMo Gym's agent servers find their model server by name in their config, one URL for every rollout, so the
adapter tells trajectories apart by the request's ``metadata["miles_session"]``: a key the ``agent`` rollout
function registered with the session's chat URL (NeMo Gym agents pass ``responses_create_params`` through to
the model, metadata included). A request with no registered key is refused (400): the adapter forwards to
registered sessions only.

The answer is a Response as NeMo Gym's vLLM model server writes it when it returns token information: the turn's
``message`` and ``function_call`` items, the last of them carrying ``prompt_token_ids``,
``generation_token_ids`` and ``generation_log_probs`` (here the session's recorded tokens and the engine's
log-probs). A turn cut by the token limit is ``incomplete`` (``max_output_tokens``). A session's refusal (its
4xx or 5xx, e.g. 409 when the history changed) comes back with the same status and message.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import aiohttp
from aiohttp import web

from miles_nemo_gym.responses import ResponsesError, assistant_items, input_to_messages, make_response, tools_to_chat

__all__ = ["ResponsesAdapter", "SESSION_KEY", "chat_request", "response_of"]

SESSION_KEY = "miles_session"
# Responses fields a chat session cannot honour unless they have these values (null always passes).
_ONLY = {"tool_choice": ("auto",), "parallel_tool_calls": (True,), "stream": (False,), "background": (False,),
         "top_logprobs": (0,), "truncation": ("disabled", "auto"), "include": ([],), "previous_response_id": (),
         "prompt": (), "reasoning": (), "max_tool_calls": (), "text": ({"format": {"type": "text"}},)}
_IGNORED = frozenset({"model", "metadata", "user", "store", "service_tier"})
_TRANSLATED = frozenset({"input", "instructions", "tools", "max_output_tokens", "temperature", "top_p"})


def chat_request(params: dict[str, Any]) -> dict[str, Any]:
    """The chat-completions request for the Responses request ``params``; a :class:`ResponsesError` names what
    cannot be translated."""
    unknown = sorted(set(params) - _TRANSLATED - _IGNORED - set(_ONLY))
    if unknown:
        raise ResponsesError(f"unsupported field(s) {', '.join(map(repr, unknown))}")
    refused = [k for k, allowed in _ONLY.items() if params.get(k) is not None and params[k] not in allowed]
    if refused:
        raise ResponsesError("; ".join(f"{k}: {json.dumps(params[k])} is not supported (only "
                                       f"{' or '.join(['null', *map(json.dumps, _ONLY[k])])})" for k in refused))
    # NeMo Gym's items carry the prompt's tokens, which a Miles session leaves out of its answers unless asked
    chat: dict[str, Any] = {"messages": input_to_messages(params.get("input"), params.get("instructions")),
                            "return_prompt_token_ids": True}
    tools = tools_to_chat(params.get("tools"))
    if tools:
        chat["tools"] = tools
    if params.get("max_output_tokens") is not None:
        chat["max_tokens"] = params["max_output_tokens"]
    chat.update({k: params[k] for k in ("temperature", "top_p") if params.get(k) is not None})
    return chat


def response_of(params: dict[str, Any], completion: dict[str, Any]) -> dict[str, Any]:
    """The Response for ``params`` from a Miles session's chat completion (its ``miles`` field has the tokens)."""
    choice, tokens = completion["choices"][0], completion.get("miles") or {}
    items = assistant_items(choice["message"], {"prompt_token_ids": tokens.get("prompt_token_ids", []),
                                                "generation_token_ids": tokens.get("token_ids", []),
                                                "generation_log_probs": tokens.get("logprobs", [])})
    usage = completion.get("usage") or {}
    return make_response(params, items, usage={"input_tokens": usage.get("prompt_tokens", 0),
                                               "output_tokens": usage.get("completion_tokens", 0)},
                         incomplete="max_output_tokens" if choice.get("finish_reason") == "length" else None)


class ResponsesAdapter:
    """Serves ``POST /v1/responses`` (and ``GET /``, NeMo Gym's liveness check) for the registered sessions."""

    def __init__(self) -> None:
        self.sessions: dict[str, str] = {}  # key -> the session's chat base URL (".../sessions/<id>/v1")
        self.app = web.Application()
        self.app.router.add_post("/v1/responses", self._responses)
        self.app.router.add_get("/", self._liveness)
        self._runner: web.AppRunner | None = None
        self._http: aiohttp.ClientSession | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on ``host:port`` (0: a free port); returns the URL NeMo Gym's agents call."""
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        try:
            await web.TCPSite(self._runner, host, port).start()
        except BaseException:
            await self.stop()
            raise
        return f"http://{host}:{self._runner.addresses[-1][1]}"

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        http, self._http = self._http, None
        if runner is not None:
            await runner.cleanup()
        if http is not None:
            await http.close()

    def register(self, chat_base_url: str) -> str:
        """A new key for requests of the session at ``chat_base_url`` (what an OpenAI client's base_url is)."""
        key = uuid.uuid4().hex
        self.sessions[key] = chat_base_url.rstrip("/")
        return key

    def unregister(self, key: str) -> None:
        self.sessions.pop(key, None)

    async def _liveness(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _responses(self, request: web.Request) -> web.Response:
        try:
            params = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the body is not JSON; expected Responses API create parameters")
        if not isinstance(params, dict):
            return _error(400, "expected a JSON object of Responses API create parameters")
        key = (params.get("metadata") or {}).get(SESSION_KEY)
        base = self.sessions.get(key) if isinstance(key, str) else None
        if base is None:
            return _error(400, f"metadata.{SESSION_KEY}: {key!r} is not a session of this adapter; the Miles agent "
                               f"rollout function sets it in responses_create_params.metadata")
        try:
            chat = chat_request(params)
        except ResponsesError as exc:
            return _error(400, f"cannot translate this Responses request to a chat completion: {exc}")
        assert self._http is not None
        try:
            async with self._http.post(f"{base}/chat/completions", json=chat) as answer:
                status, text = answer.status, await answer.text()
        except aiohttp.ClientError as exc:
            return _error(502, f"the Miles session at {base} is unreachable: {type(exc).__name__}: {exc}")
        if status != 200:  # the session's refusal, as it was
            return web.Response(text=text, status=status, content_type="application/json")
        return web.json_response(response_of(params, json.loads(text)))


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error"}}, status=status)
