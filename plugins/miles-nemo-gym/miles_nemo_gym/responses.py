"""OpenAI's Responses API shapes, as NeMo Gym 0.4.0 uses them, and chat messages, both ways.

NeMo Gym describes a task by the parameters of a Responses request (``responses_create_params``: ``input``,
``instructions``, ``tools``, ...) and a finished episode by a Response (``output``: ``message``,
``function_call`` and ``function_call_output`` items). Miles speaks chat messages. One policy turn is one
assistant chat message; as Response items it is a ``message`` item with its text (left out when the turn has
only tool calls) and one ``function_call`` item per call, ``call_id`` being the chat call's ``id``, so a
conversation survives the round trip chat -> items -> chat unchanged (the session server relies on that).
A model server adds the turn's tokens to its last item: ``prompt_token_ids``, ``generation_token_ids``,
``generation_log_probs``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

__all__ = ["ResponsesError", "input_to_messages", "messages_to_input", "tools_to_chat", "tools_to_responses",
           "assistant_items", "make_response"]

_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesError(ValueError):
    """A Responses object this adapter cannot translate; the message names the item and what was expected."""


def _text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") in _TEXT_PARTS and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ResponsesError(f"{where}.content[{i}]: only text parts ({', '.join(_TEXT_PARTS)}) are supported, "
                                     f"got {kind!r}")
            texts.append(part["text"])
        return "".join(texts)
    raise ResponsesError(f"{where}.content: expected a string or a list of text parts, got {type(content).__name__}")


def input_to_messages(items: Any, instructions: str | None = None) -> list[dict[str, Any]]:
    """The chat messages a Responses ``input`` (a string, or a list of items) stands for; ``instructions``
    become a leading system message. An assistant ``message`` item and the ``function_call`` items after it
    make one assistant message."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return messages + [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise ResponsesError(f"input: expected a string or a list of items, got {type(items).__name__}")
    assistant: dict[str, Any] | None = None  # the assistant message being gathered
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ResponsesError(f"{where}: expected an item object, got {type(item).__name__}")
        kind = item.get("type", "message")
        if kind == "message":
            role = _ROLES.get(item.get("role"))
            if role is None:
                raise ResponsesError(f"{where}: role {item.get('role')!r}; expected one of {', '.join(_ROLES)}")
            text = _text(item.get("content"), where)
            if role == "assistant":
                if assistant is None or assistant.get("tool_calls"):
                    assistant = {"role": "assistant", "content": ""}
                    messages.append(assistant)
                assistant["content"] += text
                continue
            messages.append({"role": role, "content": text})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise ResponsesError(f"{where}: a function_call item needs a string {key!r}")
            if assistant is None:
                assistant = {"role": "assistant", "content": ""}
                messages.append(assistant)
            assistant.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
            continue
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise ResponsesError(f"{where}: a function_call_output item needs a string 'call_id'")
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": output if isinstance(output, str) else _text(output, where)})
        else:
            raise ResponsesError(f"{where}: items of type {kind!r} are not supported; expected message, "
                                 f"function_call or function_call_output")
        assistant = None
    return messages


def messages_to_input(messages: Any) -> list[dict[str, Any]] | str:
    """A Miles prompt (a string, or chat messages without tool turns) as a Responses ``input``."""
    if isinstance(messages, str):
        return messages
    if not isinstance(messages, list):
        raise ResponsesError(f"prompt: expected a string or a list of chat messages, got {type(messages).__name__}")
    out = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("system", "user", "assistant", "developer") or message.get("tool_calls"):
            raise ResponsesError(f"prompt[{i}]: expected a system, user or assistant message without tool calls")
        out.append({"role": role, "content": _text(message.get("content"), f"prompt[{i}]")})
    return out


def tools_to_chat(tools: Any, where: str = "tools") -> list[dict[str, Any]]:
    """Responses function tools (``{"type": "function", "name", "description", "parameters", "strict"}``) as
    chat tools (``{"type": "function", "function": {...}}``); chat tools pass as they are."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ResponsesError(f"{where}: expected a list of function tools, got {type(tools).__name__}")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise ResponsesError(f"{where}[{i}]: only function tools are supported, got {kind!r}")
        function = tool.get("function", tool)
        if not isinstance(function.get("name"), str):
            raise ResponsesError(f"{where}[{i}]: a function tool needs a string 'name'")
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        out.append({"type": "function", "function": {
            "name": function["name"], "description": function.get("description") or "", "parameters": parameters}})
    return out


def tools_to_responses(chat_tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat tools as Responses function tools (the shape of ``responses_create_params.tools``)."""
    return [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
             "parameters": t["function"]["parameters"], "strict": False} for t in chat_tools]


def assistant_items(message: dict[str, Any], tokens: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One assistant chat message as Response output items (see the module's docstring); ``tokens``
    (``prompt_token_ids``, ``generation_token_ids``, ``generation_log_probs``) go on the last item."""
    content, calls = message.get("content") or "", message.get("tool_calls") or []
    items: list[dict[str, Any]] = []
    if content or not calls:
        items.append({"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "status": "completed",
                      "content": [{"type": "output_text", "text": content, "annotations": []}]})
    for call in calls:
        arguments = call["function"]["arguments"]
        items.append({"id": call["id"], "type": "function_call", "call_id": call["id"], "status": "completed",
                      "name": call["function"]["name"],
                      "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)})
    if tokens:
        items[-1].update(tokens)
    return items


def make_response(params: dict[str, Any], output: list[dict[str, Any]], *, usage: dict[str, int] | None = None,
                  incomplete: str | None = None) -> dict[str, Any]:
    """A Response object for the request ``params`` (its settings echoed, as OpenAI does) with ``output``;
    ``usage``: ``{"input_tokens": n, "output_tokens": m}``; ``incomplete``: why it stopped early (e.g.
    ``max_output_tokens``)."""
    echoed = ("instructions", "max_output_tokens", "metadata", "temperature", "top_p", "text", "reasoning",
              "truncation", "user", "previous_response_id", "max_tool_calls", "top_logprobs", "service_tier")
    response = {
        "id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
        "model": params.get("model") or "miles-policy", "status": "incomplete" if incomplete else "completed",
        "output": output, "tools": params.get("tools") or [], "tool_choice": params.get("tool_choice") or "auto",
        "parallel_tool_calls": params.get("parallel_tool_calls", True),
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        **{k: params[k] for k in echoed if params.get(k) is not None},
    }
    if usage is not None:
        response["usage"] = {"input_tokens": usage["input_tokens"], "output_tokens": usage["output_tokens"],
                             "total_tokens": usage["input_tokens"] + usage["output_tokens"],
                             "input_tokens_details": {"cached_tokens": 0},
                             "output_tokens_details": {"reasoning_tokens": 0}}
    return response
