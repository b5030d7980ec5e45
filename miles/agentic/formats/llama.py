"""Llama 3.1-3.3: header-delimited turns, JSON tool calls, tool results in the ``ipython`` role.

Each message is ``<|start_header_id|>ROLE<|end_header_id|>\\n\\nCONTENT<|eot_id|>`` after ``<|begin_of_text|>``.
A call is the JSON object ``{"name": ..., "parameters": {...}}`` as the assistant's turn (the model may open it
with ``<|python_tag|>``); the training template writes several calls of one turn one object per line, and the
parser reads objects one after another (separated by newlines or ``;``). Generation stops at ``<|eot_id|>``,
or at ``<|eom_id|>`` when the model expects a tool's answer (ipython mode).
"""

from __future__ import annotations

import json
import re
from typing import Any

from miles.agentic.chat_format import ChatFormat
from miles.agentic.tool_calls import call_from_object, decode_json
from miles.agentic.types import ToolCall

__all__ = ["LLAMA3", "Llama3JsonParser"]

_EXPECTED = 'expected {"name": ..., "parameters": {...}}'


class Llama3JsonParser:
    """Llama 3.x JSON calls: ``{"name": ..., "parameters": {...}}`` objects after the content, one per line (or
    separated by ``;``), optionally opened by ``<|python_tag|>``; ``arguments`` is accepted for ``parameters``.
    Calls start at the first ``<|python_tag|>`` or at the first line that opens a JSON object with a ``"name"``
    (or ``"type"``) key; the text before is the content. Registered as tool parser ``llama3_json``."""

    PYTHON_TAG = "<|python_tag|>"
    _LINE_START = re.compile(r'^[ \t]*\{\s*"(?:name|type)"\s*:', re.MULTILINE)

    def parse(self, text: str) -> list[ToolCall]:
        return self._split(text)[1]

    def content(self, text: str) -> str:
        return self._split(text)[0]

    def _start(self, text: str) -> int:
        starts = [i for i in (text.find(self.PYTHON_TAG),) if i >= 0]
        line = self._LINE_START.search(text)
        if line:
            starts.append(line.start())
        return min(starts) if starts else -1

    def _split(self, text: str) -> tuple[str, list[ToolCall]]:
        start = self._start(text)
        if start < 0:
            return text.strip(), []
        calls, pos, trailing = [], start, ""
        while True:
            while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
                pos += 1
            if text.startswith(self.PYTHON_TAG, pos):
                pos += len(self.PYTHON_TAG)
                continue
            if pos >= len(text):
                break
            if text[pos] != "{":
                trailing = text[pos:]
                break
            try:
                obj, pos = decode_json(text, pos)
            except json.JSONDecodeError as exc:
                calls.append(ToolCall("", {}, error=f"the tool call is not valid JSON ({exc.msg} at line {exc.lineno} "
                                                     f"column {exc.colno}); {_EXPECTED}"))
                end = text.find("\n", pos)
                pos = len(text) if end < 0 else end
                continue
            calls.append(_call(obj))
        content = text[:start].strip()
        if trailing.strip():
            content = f"{content}\n{trailing.strip()}" if content else trailing.strip()
        return content, calls


def _call(obj: Any) -> ToolCall:
    return call_from_object(obj, _EXPECTED, arguments_keys=("parameters", "arguments"))


LLAMA3 = ChatFormat(
    name="llama3",
    description="Llama 3.1-3.3 Instruct: JSON tool calls {\"name\", \"parameters\"}, results in the ipython role",
    end_of_turn=("<|eot_id|>",),
    stop_tokens=("<|eom_id|>",),
    tool_parser="llama3_json",
    template="llama3",
    identify=("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>"),
    template_kwargs={"date_string": "26 Jul 2024"},
    differs_from_deployment="renders several calls of one turn, one JSON object per line (the published template "
                            "raises 'only supports single tool-calls'), keeps an assistant's content before its calls, "
                            "writes string tool results as they are (the published template JSON-quotes them), takes "
                            "arguments given as a JSON string as they are (it would quote them), puts the function "
                            "definitions in the first user message rather than the message right after the system "
                            "turn, and does not render built-in tools (<|python_tag|>NAME.call(...))",
)

FORMATS = (LLAMA3,)
TOOL_PARSERS = {"llama3_json": Llama3JsonParser}
REASONING_PARSERS: dict = {}
