"""A local relay between verifiers' interception server and Miles sessions.

verifiers' bundled chat harnesses stream their completions (``stream: true``), and its eval client forwards a
streamed request upstream as a stream; Miles' session server answers whole completions only. The relay sends
each request to the session its rollout belongs to without what streaming adds (``stream``, ``stream_options``,
the ``index`` of resent tool calls) and, when the harness asked for a stream, answers with the completion as one
server-sent event followed by ``[DONE]`` (what a stream of one chunk is). Everything else, errors included,
passes through unchanged.

All rollouts share one relay URL (so verifiers keeps one upstream client); the rollout is told apart by the
``X-Session-ID`` header verifiers' client sends, the id of the rollout's trace.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
from aiohttp import web

SESSION_HEADER = "X-Session-ID"
DROPPED = ("stream", "stream_options")


class Relay:
    def __init__(self) -> None:
        self.routes: dict[str, str] = {}  # trace id -> the Miles session's base URL (ending in /v1)
        self._runner: web.AppRunner | None = None
        self._http: aiohttp.ClientSession | None = None
        self.base_url = ""

    async def start(self) -> str:
        """Listen on a free loopback port; returns the base URL the eval client is given."""
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=30))
        self.base_url = f"http://127.0.0.1:{self._runner.addresses[0][1]}/v1"
        return self.base_url

    async def stop(self) -> None:
        if self._http is not None:
            await self._http.close()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _chat(self, request: web.Request) -> web.Response:
        upstream = self.routes.get(request.headers.get(SESSION_HEADER, ""))
        if upstream is None:
            return _error(404, f"no Miles session for rollout {request.headers.get(SESSION_HEADER)!r}")
        body = await request.json()
        stream = bool(body.get("stream"))
        _unstream(body)
        assert self._http is not None
        try:
            async with self._http.post(f"{upstream}/chat/completions", json=body) as answer:
                payload = await answer.read()
                if answer.status != 200 or not stream:
                    return web.Response(body=payload, status=answer.status, content_type=answer.content_type)
        except aiohttp.ClientError as exc:
            return _error(502, f"the Miles session {upstream} cannot be reached: {type(exc).__name__}: {exc}")
        return web.Response(body=_as_stream(json.loads(payload)), content_type="text/event-stream")


def _unstream(body: dict[str, Any]) -> None:
    """The request without what streaming adds: ``stream``, ``stream_options``, and the ``index`` an OpenAI
    client's stream accumulator leaves on each tool call of the assistant messages it sends back."""
    for key in DROPPED:
        body.pop(key, None)
    for message in body.get("messages") or []:
        if isinstance(message, dict) and message.get("role") == "assistant":
            for call in message.get("tool_calls") or []:
                if isinstance(call, dict):
                    call.pop("index", None)


def _as_stream(completion: dict[str, Any]) -> bytes:
    """A whole chat completion as a stream of one chunk (its message as the delta) and the end marker."""
    chunk = {key: value for key, value in completion.items() if key != "choices"}
    chunk["object"] = "chat.completion.chunk"
    chunk["choices"] = []
    for choice in completion.get("choices") or []:
        delta = dict(choice.get("message") or {})
        if delta.get("tool_calls"):
            delta["tool_calls"] = [{**call, "index": i} for i, call in enumerate(delta["tool_calls"])]
        chunk["choices"].append({"index": choice.get("index", 0), "delta": delta,
                                 "finish_reason": choice.get("finish_reason")})
    return f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                        "code": None}}, status=status)
