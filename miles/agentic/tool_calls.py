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
from dataclasses import dataclass
from typing import Any

import jsonschema

from miles.agentic.types import ToolCall

__all__ = ["CheckedCalls", "HermesParser", "PythonBlockParser", "call_from_object", "check_calls", "set_arguments"]


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
            obj = json.loads(body)
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
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as exc:
            call.error = (f"the arguments of {name}{where} are not valid JSON ({exc.msg} at line {exc.lineno} column "
                          f"{exc.colno}); expected a JSON object")
            return call
    if not isinstance(value, dict):
        call.error = f"the arguments of {name}{where} must be a JSON object, got {type(value).__name__}"
        return call
    call.arguments = value
    return call


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
