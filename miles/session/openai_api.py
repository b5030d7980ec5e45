"""The OpenAI chat-completions protocol as the session server speaks it: which request fields it honours,
how messages are normalised before a session compares them with the ones it holds, and the answer's shape.

A message is normalised so that what the OpenAI client sends back equals what the server answered:
fields that are null are dropped, ``content`` null or missing is ``""`` (a list of text parts is joined; a list
holding image parts stays a list, each image part as ``{"type": "image_url", "image_url": {"url": URL}}``),
an empty or null ``tool_calls`` is dropped, and a call's ``arguments`` (a string, as in OpenAI's schema) is
parsed to the object when it is JSON (a string that is not JSON stays a string), its ``type`` defaults to
``function``.

Every field is checked against the type OpenAI's schema gives it before anything else happens: a request that
breaks it is a 400 naming the field (``messages[2].tool_calls[0].function.arguments``), never an error later on.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import jsonschema

from miles.agentic.tool_calls import CheckedCalls, check_calls
from miles.agentic.turns import message_parts
from miles.agentic.types import Message

__all__ = ["ApiError", "ChatRequest", "parse_chat_request", "normalize_message", "normalize_tools",
           "first_difference", "assistant_turn", "completion_answer", "check_depth", "MAX_DEPTH"]

ROLES = ("system", "user", "assistant", "tool")
# return_prompt_token_ids is Miles's own: the answer's `miles.prompt_token_ids` (the whole prompt) when true
HONOURED = frozenset({"messages", "tools", "max_tokens", "max_completion_tokens", "temperature", "top_p", "logprobs",
                      "return_prompt_token_ids"})
# Bookkeeping the server has no use for: accepted whatever their value, as long as it has the type OpenAI's schema
# gives it (null always).
IGNORED = {"model": str, "user": str, "metadata": dict, "store": bool, "service_tier": str, "safety_identifier": str,
           "prompt_cache_key": str, "prompt_cache_retention": str}
# Containers within containers that a request may nest: far more than any chat request needs (a tool's JSON schema
# included), few enough that comparing, rendering and answering it never reaches Python's recursion limit.
MAX_DEPTH = 64
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
    return_prompt_token_ids: bool = False


def parse_chat_request(body: dict[str, Any]) -> ChatRequest:
    """The request's fields, checked; an :class:`ApiError` (400) names every field the server cannot honour."""
    check_depth(body, "body")
    unknown = sorted(set(body) - HONOURED - set(IGNORED) - set(ONLY))
    if unknown:
        raise ApiError(400, f"unsupported field(s) {', '.join(map(repr, unknown))}; this server honours "
                            f"{', '.join(sorted(HONOURED))} (and model, user, metadata, ... which it ignores)",
                       param=unknown[0], code="unsupported_parameter")
    for name, kind in IGNORED.items():
        if body.get(name) is not None and not _is_a(body[name], kind):
            raise ApiError(400, f"{name}: expected {_TYPE_NAMES[kind]}, got {_json_type(body[name])}", param=name)
    refused = [k for k, allowed in ONLY.items() if k in body and body[k] is not None
               and not any(_same(body[k], a) for a in allowed)]
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
    for name in ("logprobs", "return_prompt_token_ids"):
        _expect(body.get(name), bool, name, optional=True)
    return ChatRequest(normalised, normalize_tools(body.get("tools")), next(iter(limits.values()), None),
                       temperature, top_p, bool(body.get("logprobs")), body.get("model") or "miles",
                       bool(body.get("return_prompt_token_ids")))


def check_depth(value: Any, where: str, limit: int = MAX_DEPTH) -> None:
    """Refuse (400, naming where; the field, when ``where`` is the whole body) a value with containers nested more
    than ``limit`` deep. Iterative: a value the JSON parser accepted may still be too deep for what recursion does
    with it later (compare, render, answer)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth >= limit:
                steps = _steps_to_depth(value, limit)
                shown = "".join(steps[:8]) + ("..." if len(steps) > 8 else "")
                field = "".join(steps[:3]).lstrip(".") if where == "body" else where  # the body: its field
                raise ApiError(400, f"{where}{shown}: nested too deeply (objects and arrays more than {limit} levels "
                                    f"within each other)", param=field)
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))


def _steps_to_depth(value: Any, limit: int) -> list[str]:
    """The path (``.key`` and ``[index]`` steps) to where ``value`` first reaches ``limit`` levels; built only once a
    value is known to be too deep (a path per item would cost more than the check)."""
    stack: list[tuple[Any, list[str]]] = [(value, [])]
    while stack:
        item, steps = stack.pop()
        if isinstance(item, (dict, list)):
            if len(steps) >= limit:
                return steps
            children = item.items() if isinstance(item, dict) else enumerate(item)
            stack.extend((v, steps + [f".{k}" if isinstance(item, dict) else f"[{k}]"]) for k, v in children)
    return []


def normalize_message(message: Any, where: str) -> Message:
    """``message`` in the form sessions compare and render (see the module's docstring), its fields checked against
    OpenAI's schema."""
    if not isinstance(message, dict):
        raise ApiError(400, f"{where}: expected a chat message (an object with role and content), got "
                            f"{_json_type(message)}", param=where)
    if message.get("role") not in ROLES:
        got = message.get("role")
        raise ApiError(400, f"{where}.role: expected one of {', '.join(ROLES)}; got {json.dumps(got)}",
                       param=f"{where}.role")
    for key in ("name", "tool_call_id", "refusal"):
        _expect(message.get(key), str, f"{where}.{key}", optional=True)
    for key in ("audio", "function_call"):  # an echoed answer's fields (null from the OpenAI client)
        _expect(message.get(key), dict, f"{where}.{key}", optional=True)
    out = {k: v for k, v in message.items() if v is not None}
    out["content"] = _content(message.get("content"), f"{where}.content")
    calls = out.pop("tool_calls", None)
    calls = [] if calls is None else calls
    if not isinstance(calls, list):
        raise ApiError(400, f"{where}.tool_calls: expected an array of tool calls, got {_json_type(calls)}",
                       param=f"{where}.tool_calls")
    if calls and message["role"] != "assistant":
        raise ApiError(400, f"{where}.tool_calls: only an assistant message carries tool calls",
                       param=f"{where}.tool_calls")
    if calls:
        out["tool_calls"] = [_call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(calls)]
    return out


def normalize_tools(tools: Any) -> list[dict[str, Any]] | None:
    """The request's function tools, checked; None for none (missing, null or empty)."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise ApiError(400, f"tools: expected an array of function tools, got {_json_type(tools)}", param="tools")
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        _expect(t, dict, where)
        if t.get("type") not in ("function", None):
            raise ApiError(400, f'{where}.type: expected "function", got {_show(t["type"])}', param=f"{where}.type")
        function = t.get("function")
        _expect(function, dict, f"{where}.function")
        _expect(function.get("name"), str, f"{where}.function.name")
        _expect(function.get("description"), str, f"{where}.function.description", optional=True)
        _expect(function.get("strict"), bool, f"{where}.function.strict", optional=True)
        parameters = function.get("parameters")
        _expect(parameters, dict, f"{where}.function.parameters", optional=True)
        try:
            jsonschema.Draft202012Validator.check_schema(parameters or {})
        except jsonschema.SchemaError as exc:
            raise ApiError(400, f"{where}.function.parameters: not a valid JSON schema: {exc.message}",
                           param=f"{where}.function.parameters") from exc
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
    """The assistant message a generated turn stands for (:func:`~miles.agentic.turns.message_parts`: what the
    template renders back as generated), and every call found. Without tools nothing is parsed: the whole text is
    the content."""
    if not tools:
        return {"role": "assistant", "content": text}, CheckedCalls([])
    parsed = parser.parse(text)
    content, calls = message_parts(parser, text, parsed)  # as the template renders the turn back
    checked = check_calls(parsed, tools)
    for i, call in enumerate(checked.calls):
        call.id = f"{call_id_prefix}{i}"  # unique within the session: the parser numbers each turn from 0
    message: Message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
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


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content, normalised: its text, or (when it holds images) its text and image parts in order."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ApiError(400, f'{where}: expected a string or an array of content parts ({{"type": "text", "text": '
                            f'...}} or {{"type": "image_url", "image_url": {{"url": ...}}}}), got '
                            f'{_json_type(content)}', param=where)
    parts = [_part(part, f"{where}[{i}]") for i, part in enumerate(content)]
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _part(part: Any, where: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    url = part.get("image_url") if kind == "image_url" else None
    if isinstance(url, dict) and isinstance(url.get("url"), str) and url.get("detail") in (None, "auto", "low", "high"):
        return {"type": "image_url", "image_url": {"url": url["url"]}}  # detail: the engine sees the image as is
    got = _show(part) if isinstance(part, dict) else _json_type(part)
    raise ApiError(400, f'{where}: expected a text part {{"type": "text", "text": "..."}} or an image part '
                        f'{{"type": "image_url", "image_url": {{"url": "data:image/png;base64,..."}}}} (detail auto, '
                        f'low or high), got {got}', param=where)


def _call(call: Any, where: str) -> dict[str, Any]:
    _expect(call, dict, where)
    _expect(call.get("id"), str, f"{where}.id", optional=True)
    if call.get("type") not in ("function", None):
        raise ApiError(400, f'{where}.type: expected "function", got {_show(call["type"])}', param=f"{where}.type")
    function = call.get("function")
    _expect(function, dict, f"{where}.function")
    _expect(function.get("name"), str, f"{where}.function.name")
    arguments = function.get("arguments")
    _expect(arguments, str, f"{where}.function.arguments", optional=True, what="a string (the arguments as JSON)")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            pass  # kept as sent: compared as the string
        else:
            check_depth(arguments, f"{where}.function.arguments")  # a string holds any depth: as deep as the body
    out = {k: v for k, v in call.items() if v is not None}
    out["type"] = "function"
    out["function"] = {**{k: v for k, v in function.items() if v is not None}, "arguments": arguments}
    return out


def _show(value: Any, limit: int = 80) -> str:
    if value is None:
        return "(absent)"
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_TYPE_NAMES = {str: "a string", dict: "an object", list: "an array", bool: "true or false"}


def _json_type(value: Any) -> str:
    """The JSON name of ``value``'s type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"a number ({_show(value)})"
    return {str: "a string", dict: "an object", list: "an array"}.get(type(value), type(value).__name__)


def _is_a(value: Any, kind: type) -> bool:
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


def _expect(value: Any, kind: type, where: str, *, optional: bool = False, what: str = "") -> None:
    """Refuse (400 naming ``where``) a value that is not of JSON type ``kind`` (null too, unless ``optional``)."""
    if value is None and optional or _is_a(value, kind):
        return
    raise ApiError(400, f"{where}: expected {what or _TYPE_NAMES[kind]}, got {_json_type(value)}", param=where)


def _same(value: Any, allowed: Any) -> bool:
    """``value`` equals ``allowed`` without Python's loose equalities (true is not 1, 0 is not false)."""
    if isinstance(value, bool) != isinstance(allowed, bool):
        return False
    return value == allowed and (_is_number(value) if _is_number(allowed) else type(value) is type(allowed))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
