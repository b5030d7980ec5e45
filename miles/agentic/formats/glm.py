"""GLM-4.5 and GLM-4.6: role tokens, XML-style tool calls, ``<think>`` reasoning.

Messages are opened by ``<|system|>``, ``<|user|>``, ``<|assistant|>`` and ``<|observation|>`` (tool results) and
closed by nothing: the model ends its turn by generating the next role token, ``<|observation|>`` after calls or
``<|user|>`` after an answer (or ``<|endoftext|>``). Those are the format's next-role tokens, so the tokens after
such a turn start right after the one the model generated. A call is
``<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n...</tool_call>`` with each argument's value
as text (a string as is, anything else as JSON); the template reads the arguments as a mapping.
"""

from __future__ import annotations

import json
import re
from typing import Any

from miles.agentic.chat_format import ChatFormat
from miles.agentic.tool_calls import RefusedJSON, loads_json
from miles.agentic.types import ToolCall

__all__ = ["GLM45", "Glm45ToolParser"]


class Glm45ToolParser:
    """GLM-4.5 calls: ``<tool_call>NAME`` then ``<arg_key>K</arg_key>`` / ``<arg_value>V</arg_value>`` pairs then
    ``</tool_call>``, several per turn. A value that reads as a JSON number, boolean, null, object or array is
    decoded; any other value is a string, as written (without the tools' schemas a string argument whose text is
    valid JSON, such as ``"42"``, is decoded too). The text outside the calls is the content. Registered as tool
    parser ``glm45``."""

    _CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> list[ToolCall]:
        calls = []
        for match in self._CALL.finditer(text):
            call = ToolCall("", {})
            body = match.group(1)
            head = body.split("<", 1)[0]
            call.name = head.strip()
            if not match.group(2):
                call.error = f"the tool call{_named(call.name)} is not closed with </tool_call>"
            elif not call.name or "\n" in call.name:
                call.name, call.error = "", ("the tool call has no function name: expected <tool_call>NAME followed "
                                             "by <arg_key>...</arg_key><arg_value>...</arg_value> pairs")
            else:
                call.error = self._arguments(body[len(head):], call)
            calls.append(call)
        return calls

    def content(self, text: str) -> str:
        return self._CALL.sub("", text).strip()

    @staticmethod
    def _arguments(body: str, call: ToolCall) -> str | None:
        """Fill ``call.arguments`` from the ``<arg_key>``/``<arg_value>`` pairs of ``body``; the error, if any."""
        pos, where = 0, f" of {call.name}"
        while True:
            while pos < len(body) and body[pos].isspace():
                pos += 1
            if pos >= len(body):
                return None
            if not body.startswith("<arg_key>", pos):
                return (f"unexpected text {body[pos:pos + 40]!r} in the tool call{where}: expected "
                        f"<arg_key>NAME</arg_key> then <arg_value>VALUE</arg_value>")
            end = body.find("</arg_key>", pos)
            if end < 0:
                return f"an argument name in the tool call{where} is not closed with </arg_key>"
            key = body[pos + len("<arg_key>"):end].strip()
            pos = end + len("</arg_key>")
            while pos < len(body) and body[pos].isspace():
                pos += 1
            if not body.startswith("<arg_value>", pos):
                return f"argument {key!r} of {call.name} has no <arg_value>...</arg_value> after its </arg_key>"
            end = body.find("</arg_value>", pos)
            if end < 0:
                return f"the value of argument {key!r} of {call.name} is not closed with </arg_value>"
            if key in call.arguments:
                return f"argument {key!r} of {call.name} is given twice"
            try:
                call.arguments[key] = _value(body[pos + len("<arg_value>"):end])
            except RefusedJSON as exc:
                return f"the value of argument {key!r} of {call.name} cannot be read: {exc.msg}"
            pos = end + len("</arg_value>")


def _named(name: str) -> str:
    return f" to {name}" if name and "\n" not in name else ""


def _value(text: str) -> Any:
    """The argument's value: decoded JSON, else the text as written; JSON that a call cannot carry (too deep, an
    integer too long, a lone surrogate) raises :class:`RefusedJSON` rather than passing for a string."""
    try:
        value = loads_json(text)
    except RefusedJSON:
        raise
    except json.JSONDecodeError:
        return text
    return text if isinstance(value, str) else value


GLM45 = ChatFormat(
    name="glm45",
    description="GLM-4.5 / GLM-4.6: <think> reasoning, <tool_call> with <arg_key>/<arg_value> pairs, "
                "turns ended by the next role token",
    end_of_turn=("<|endoftext|>",),
    next_role_tokens=("<|observation|>", "<|user|>"),
    tool_parser="glm45",
    reasoning_parser="think",
    reasoning_field="reasoning_content",
    arguments="mapping",
    template="glm45",
    identify=("[gMASK]", "<sop>", "<|system|>", "<|assistant|>"),
    template_markers=("<arg_key>",),
    template_kwargs={"enable_thinking": True},
    differs_from_deployment="keeps every turn's reasoning; the published template renders an empty <think></think> "
                            "for assistant turns before the last user message",
)

FORMATS = (GLM45,)
TOOL_PARSERS = {"glm45": Glm45ToolParser}
REASONING_PARSERS: dict = {}
