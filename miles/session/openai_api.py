"""The OpenAI chat-completions protocol as the session server speaks it: which request fields it honours,
how messages are normalised before a session compares them with the ones it holds, and the answer's shape.

A message is normalised so that what the OpenAI client sends back equals what the server answered:
fields that are null are dropped, ``content`` null or missing is ``""`` (a list of text parts is joined),
an empty or null ``tool_calls`` is dropped, and a call's ``arguments`` given as a JSON string is parsed to
the object (a string that is not JSON stays a string), its ``type`` defaults to ``function``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from miles.agentic.tool_calls import CheckedCalls, check_calls
from miles.agentic.types import Message

__all__ = ["ApiError", "ChatRequest", "parse_chat_request", "normalize_message", "normalize_tools",
           "first_difference", "assistant_turn", "completion_answer"]

ROLES = ("system", "user", "assistant", "tool")
HONOURED = frozenset({"messages", "tools", "max_tokens", "max_completion_tokens", "temperature", "top_p", "logprobs"})
# Bookkeeping the server has no use for: accepted whatever their value.
IGNORED = frozenset({"model", "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
                     "prompt_cache_retention"})
# Accepted at these values only (null always): what the server does anyway.
ONLY = {"n": (1,), "stream": (False,), "stop": ([],), "tool_choice": ("auto",), "parallel_tool_calls": (True,),
        "top_logprobs": (0,), "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "stream_options": (),
        "seed": (), "logit_bias": ({},), "response_format": ({"type": "text"},), "reasoning_effort": (),
        "prediction": (), "audio": (), "modalities": (["text"],), "functions": (), "function_call": (),
        "web_search_options": (), "verbosity": ()}


class ApiError(Exception):
    """A refused request, answered in OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict[str, Any]:
        kind = {404: "not_found_error", 409: "conflict_error"}.get(self.status, "invalid_request_error")
        return {"error": {"message": str(self), "type": kind if self.status < 500 else "server_error",
                          "param": self.param, "code": self.code}}


@dataclass
class ChatRequest:
    messages: list[Message]  # normalised
    tools: list[dict[str, Any]] | None  # None: no tools
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    logprobs: bool
    model: str


def parse_chat_request(body: dict[str, Any]) -> ChatRequest:
    """The request's fields, checked; an :class:`ApiError` (400) names every field the server cannot honour."""
    unknown = sorted(set(body) - HONOURED - IGNORED - set(ONLY))
    if unknown:
        raise ApiError(400, f"unsupported field(s) {', '.join(map(repr, unknown))}; this server honours "
                            f"{', '.join(sorted(HONOURED))} (and model, user, metadata, ... which it ignores)",
                       param=unknown[0], code="unsupported_parameter")
    refused = [k for k, allowed in ONLY.items() if k in body and body[k] is not None and body[k] not in allowed]
    if refused:
        detail = "; ".join(f"{k}: got {json.dumps(body[k])}, supported: "
                           f"{' or '.join(['null', *map(json.dumps, ONLY[k])])}" for k in refused)
        raise ApiError(400, f"unsupported value(s): {detail}", param=refused[0], code="unsupported_value")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages: expected a non-empty list of chat messages", param="messages")
    normalised = [normalize_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
    limits = {k: body[k] for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None}
    for name, value in limits.items():
        if not _is_int(value) or value < 1:
            raise ApiError(400, f"{name}: expected an integer >= 1, got {json.dumps(value)}", param=name)
    if len(set(limits.values())) > 1:
        raise ApiError(400, "max_tokens, max_completion_tokens: send one of them (or the same value)",
                       param="max_tokens")
    temperature, top_p = body.get("temperature"), body.get("top_p")
    if temperature is not None and not (_is_number(temperature) and 0 <= temperature <= 2):
        raise ApiError(400, f"temperature: expected a number in [0, 2], got {json.dumps(temperature)}",
                       param="temperature")
    if top_p is not None and not (_is_number(top_p) and 0 < top_p <= 1):
        raise ApiError(400, f"top_p: expected a number in (0, 1], got {json.dumps(top_p)}", param="top_p")
    if body.get("logprobs") not in (None, True, False):
        raise ApiError(400, f"logprobs: expected true or false, got {json.dumps(body['logprobs'])}", param="logprobs")
    model = body.get("model")
    return ChatRequest(normalised, normalize_tools(body.get("tools")), next(iter(limits.values()), None),
                       temperature, top_p, bool(body.get("logprobs")), model if isinstance(model, str) else "miles")


def normalize_message(message: Any, where: str) -> Message:
    """``message`` in the form sessions compare and render (see the module's docstring)."""
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        got = message.get("role") if isinstance(message, dict) else type(message).__name__
        raise ApiError(400, f"{where}: expected a message with role {', '.join(ROLES)}; got {json.dumps(got)}",
                       param=where)
    out = {k: v for k, v in message.items() if v is not None}
    out["content"] = _text(message.get("content"), f"{where}.content")
    calls = out.pop("tool_calls", None) or []
    if calls and message["role"] != "assistant":
        raise ApiError(400, f"{where}.tool_calls: only an assistant message carries tool calls", param=where)
    if not isinstance(calls, list):
        raise ApiError(400, f"{where}.tool_calls: expected a list", param=f"{where}.tool_calls")
    if calls:
        out["tool_calls"] = [_call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(calls)]
    return out


def normalize_tools(tools: Any) -> list[dict[str, Any]] | None:
    """The request's function tools, checked; None for none (missing, null or empty)."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise ApiError(400, "tools: expected a list of function tools", param="tools")
    for i, t in enumerate(tools):
        function = t.get("function") if isinstance(t, dict) else None
        if not isinstance(function, dict) or t.get("type", "function") != "function" or not isinstance(
                function.get("name"), str) or not isinstance(function.get("parameters", {}), dict):
            raise ApiError(400, f'tools[{i}]: expected {{"type": "function", "function": {{"name": ..., '
                                f'"parameters": {{...}}}}}}', param=f"tools[{i}]")
    return tools


def first_difference(held: list[Message], sent: list[Message]) -> tuple[int, str] | None:
    """Where and why ``sent`` does not start with ``held`` (both normalised): the index of the first message that
    differs (or is missing) and what changed; None when it does."""
    for i, (a, b) in enumerate(zip(held, sent)):
        if a != b:
            changes = [f"{k} {_show(a.get(k))} became {_show(b.get(k))}" for k in sorted(set(a) | set(b))
                       if a.get(k) != b.get(k)]
            return i, f"messages[{i}] ({a.get('role')}) differs from the one this session holds: {'; '.join(changes)}"
    if len(sent) < len(held):
        return len(sent), (f"messages[{len(sent)}] is missing: the request has {len(sent)} messages, this session "
                           f"holds {len(held)} (the earlier requests' messages and the assistant answers it gave); "
                           f"send them all, unchanged, then the new ones")
    return None


def assistant_turn(text: str, parser: Any, tools: list[dict[str, Any]] | None,
                   call_id_prefix: str) -> tuple[Message, CheckedCalls]:
    """The assistant message a generated turn stands for (normalised: the content without tool calls, the valid
    calls), and every call found. Without tools nothing is parsed: the whole text is the content."""
    if not tools:
        return {"role": "assistant", "content": text}, CheckedCalls([])
    checked = check_calls(parser.parse(text), tools)
    for i, call in enumerate(checked.calls):
        call.id = f"{call_id_prefix}{i}"  # unique within the session: the parser numbers each turn from 0
    message: Message = {"role": "assistant", "content": parser.content(text)}
    if checked.valid:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in checked.valid]
    return message, checked


def completion_answer(*, completion_id: str, model: str, message: Message, finish_reason: str, prompt_tokens: int,
                      completion_tokens: int, logprobs: dict[str, Any] | None,
                      extra: dict[str, Any]) -> dict[str, Any]:
    """A ``chat.completion`` object; the stored (normalised) ``message`` goes out in OpenAI's shape, its calls'
    arguments as JSON strings, and ``extra`` as the top-level ``miles`` field."""
    out: dict[str, Any] = {"role": "assistant", "content": message["content"]}
    if message.get("tool_calls"):
        out["content"] = message["content"] or None
        out["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
                             for c in message["tool_calls"]]
    return {
        "id": completion_id, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": out, "finish_reason": finish_reason, "logprobs": logprobs}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
        "miles": extra,
    }


def _text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f'{where}: expected a string or a list of text parts ({{"type": "text", "text": ...}})',
                   param=where)


def _call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or call.get(
            "type", "function") not in ("function", None):
        raise ApiError(400, f'{where}: expected {{"id": ..., "type": "function", "function": {{"name": ..., '
                            f'"arguments": ...}}}}', param=where)
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass  # kept as sent: compared as the string
    out = {k: v for k, v in call.items() if v is not None}
    out["type"] = "function"
    out["function"] = {**{k: v for k, v in function.items() if v is not None}, "arguments": arguments}
    return out


def _show(value: Any, limit: int = 80) -> str:
    if value is None:
        return "(absent)"
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
