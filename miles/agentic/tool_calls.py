"""Finding tool calls in generated text and checking them against the tools' JSON schemas.

A parser (registry kind ``tool_parser``) only finds calls; :func:`check_calls` validates every call
the same way for all parsers. A parser sets a call's ``id`` only when the generated text carries one; the
rollout gives the others the chat format's ids (:func:`miles.agentic.turns.read_turn`). A call that cannot
be used carries an ``error`` that goes back to the model as an observation, and is counted as a parse error
(the text is not a call) or a schema error (an unknown tool, or arguments that break the tool's schema).
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from typing import Any

import jsonschema

from miles.agentic.types import ToolCall

__all__ = ["MAX_DEPTH", "CheckedCalls", "HermesParser", "PythonBlockParser", "call_from_object", "check_calls",
           "decode_json", "loads_json", "set_arguments", "RefusedJSON"]

# Objects and arrays within each other that a call may nest: far more than any tool's arguments need, few enough that
# checking, rendering and running a call never reaches Python's recursion limit (the session server's limit too).
MAX_DEPTH = 64
_TOO_DEEP = f"nested too deeply (objects and arrays more than {MAX_DEPTH} levels within each other)"
_DECODER = json.JSONDecoder()
_WHITESPACE = re.compile(r"[ \t\n\r]*")  # what JSON counts as whitespace around a value
_SURROGATE = re.compile("[\ud800-\udfff]")


class HermesParser:
    """Hermes/Qwen calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, several per turn.
    Registered as tool parser ``hermes``."""

    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> list[ToolCall]:
        calls = []
        for match in self._CALL.finditer(text):
            call = ToolCall(name="", arguments={})
            if not match.group(0).endswith("</tool_call>"):
                call.error = "the tool call is not closed with </tool_call>"
            else:
                self._decode(match.group(1).strip(), call)
            calls.append(call)
        return calls

    def content(self, text: str) -> str:
        return self._CALL.sub("", text).strip()

    @staticmethod
    def _decode(body: str, call: ToolCall) -> None:
        try:
            obj = loads_json(body)
        except json.JSONDecodeError as exc:
            call.error = f"the tool call is not valid JSON ({exc}); expected {{\"name\": ..., \"arguments\": {{...}}}}"
            return
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            call.error = 'the tool call must be a JSON object with a string "name" and an object "arguments"'
            return
        call.name = obj["name"]
        set_arguments(call, obj.get("arguments", {}))


class PythonBlockParser:
    """A fenced block (```python ... ```) is a call of the Python tool with the block as its code argument.
    Registered as tool parser ``python_block``."""

    _BLOCK = re.compile(r"```(?:python|py)[ \t]*\n(.*?)(?:```|$)", re.DOTALL)

    turn_layout = "inline"  # the code is written in the turn's text, which the template renders as it is

    def __init__(self, tool: str = "execute_python_code", argument: str = "code") -> None:
        self.tool, self.argument = tool, argument

    def parse(self, text: str) -> list[ToolCall]:
        calls = []
        for match in self._BLOCK.finditer(text):
            call = ToolCall(name=self.tool, arguments={self.argument: match.group(1)})
            if not match.group(0).endswith("```"):
                call.error = "the python block is not closed with ```"
            calls.append(call)
        return calls

    def content(self, text: str) -> str:
        return self._BLOCK.sub("", text).strip()


def set_arguments(call: ToolCall, value: Any, key: str = "arguments") -> ToolCall:
    """Set ``call.arguments`` from a call's arguments as the model wrote them: a JSON object (decoded), or a
    string holding one (some models send the arguments as a JSON string). Anything else sets ``call.error``,
    naming the tool and, when it is not ``arguments``, the field (``key``) the model wrote them in."""
    where = f' (in "{key}")' if key != "arguments" else ""
    name = call.name or "the tool call"
    if isinstance(value, str):
        try:
            value = loads_json(value) if value.strip() else {}
        except json.JSONDecodeError as exc:
            call.error = (f"the arguments of {name}{where} are not valid JSON ({exc.msg} at line {exc.lineno} column "
                          f"{exc.colno}); expected a JSON object")
            return call
    if not isinstance(value, dict):
        call.error = f"the arguments of {name}{where} must be a JSON object, got {type(value).__name__}"
        return call
    call.arguments = value
    return call


class RefusedJSON(json.JSONDecodeError):
    """JSON that may be well-formed but that a call cannot carry: nested more than :data:`MAX_DEPTH` deep, an integer
    with more digits than Python converts, a string holding half of a UTF-16 surrogate pair (no character; the
    tokenizer refuses it when the call is rendered back)."""


def decode_json(text: str, pos: int = 0) -> tuple[Any, int]:
    """The JSON value that starts at ``text[pos]`` and the index after it (``json.JSONDecoder.raw_decode``). Every way
    generated text can fail to decode is a :class:`json.JSONDecodeError` saying what was wrong, which the parsers turn
    into the call's error: bad syntax, and the :class:`RefusedJSON` cases (json's decoder recurses, so 100,000 levels
    raise RecursionError; a 5000-digit integer raises ValueError)."""
    try:
        value, end = _DECODER.raw_decode(text, pos)
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise RefusedJSON(_TOO_DEEP, text, pos) from None
    except ValueError as exc:  # the only other ValueError json raises: an integer too long to convert
        limit = sys.get_int_max_str_digits()
        long_int = re.compile(rf"\d{{{limit + 1},}}").search(text, pos) if limit else None
        if long_int is None:
            raise RefusedJSON(str(exc), text, pos) from None
        raise RefusedJSON(f"an integer has {long_int.end() - long_int.start()} digits, more than the {limit} Python "
                          f"converts", text, long_int.start()) from None
    problem = _refused(value)
    if problem is not None:
        raise RefusedJSON(problem, text, pos)
    return value, end


def loads_json(text: str) -> Any:
    """``json.loads(text)`` with :func:`decode_json`'s errors: the one JSON value that ``text`` holds."""
    value, end = decode_json(text, _WHITESPACE.match(text).end())
    end = _WHITESPACE.match(text, end).end()
    if end != len(text):
        raise json.JSONDecodeError("Extra data", text, end)
    return value


def _refused(value: Any) -> str | None:
    """Why a decoded value cannot be a call's (too deep, a lone surrogate); None when it can. Iterative: any depth."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if (half := _SURROGATE.search(item)) is not None:
                return (f"the string {item[:40]!r} holds \\u{ord(half.group()):04x}, half of a surrogate pair, "
                        f"which is no character")
        elif isinstance(item, (dict, list)):
            if depth >= MAX_DEPTH:
                return _TOO_DEEP
            items = [*item, *item.values()] if isinstance(item, dict) else item
            stack.extend((v, depth + 1) for v in items)
    return None


def call_from_object(obj: Any, expected: str, arguments_keys: tuple[str, ...] = ("arguments",),
                     id_key: str | None = None) -> ToolCall:
    """A call from a decoded JSON object ``{"name": ..., "<arguments key>": ..., "<id key>": ...}`` (Llama's
    ``parameters``, Mistral's ``id``); ``expected`` describes the form for the error of a wrong object."""
    call = ToolCall("", {})
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        call.error = f'each tool call must be a JSON object with a string "name"; {expected}'
        return call
    call.name = obj["name"]
    if id_key is not None and isinstance(obj.get(id_key), str):
        call.id = obj[id_key]
    key = next((k for k in arguments_keys if k in obj), arguments_keys[0])
    return set_arguments(call, obj.get(key, {}), key)


@dataclass
class CheckedCalls:
    calls: list[ToolCall]  # in the order generated; the ones with `error` set are not run
    parse_errors: int = 0
    schema_errors: int = 0

    @property
    def valid(self) -> list[ToolCall]:
        return [c for c in self.calls if c.error is None]


def check_calls(calls: list[ToolCall], tools: list[dict[str, Any]]) -> CheckedCalls:
    """Validate parsed calls against the OpenAI function schemas ``tools``; set ``error`` on the bad ones."""
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
    checked = CheckedCalls(calls)
    for call in calls:
        if call.error is not None:
            checked.parse_errors += 1
        elif call.name not in schemas:
            call.error = f"unknown tool {call.name!r}; available: {', '.join(sorted(schemas)) or 'none'}"
            checked.schema_errors += 1
        else:
            problems = sorted(jsonschema.Draft202012Validator(schemas[call.name]).iter_errors(call.arguments),
                              key=lambda e: list(e.path))
            if problems:
                detail = "; ".join(f"{'.'.join(map(str, e.path)) or 'arguments'}: {e.message}" for e in problems)
                call.error = (f"{len(problems)} validation error{'s' * (len(problems) > 1)} for {call.name}: "
                              f"{detail}")
                checked.schema_errors += 1
    return checked
