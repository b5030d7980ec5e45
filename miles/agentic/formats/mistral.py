"""Mistral instruct v3 (Mistral-7B-Instruct-v0.3, Mixtral-8x22B-Instruct, Mistral-Large-2407).

Turns are ``[INST] USER[/INST]`` and `` ANSWER</s>``; a turn with calls is
``[TOOL_CALLS] [{"name": ..., "arguments": {...}, "id": "abcDEF123"}, ...]</s>``, each result
``[TOOL_RESULTS] {"content": ..., "call_id": "abcDEF123"}[/TOOL_RESULTS]``. Call ids are nine letters and digits,
and the model writes them itself; the parser keeps them.
"""

from __future__ import annotations

import json
from typing import Any

from miles.agentic.chat_format import ChatFormat
from miles.agentic.tool_calls import call_from_object, decode_json
from miles.agentic.types import ToolCall

__all__ = ["MISTRAL_V3", "MistralToolParser"]

_EXPECTED = 'expected [{"name": ..., "arguments": {...}, "id": ...}, ...]'


class MistralToolParser:
    """Mistral calls: ``[TOOL_CALLS]`` followed by a JSON list of ``{"name", "arguments", "id"}`` objects (a single
    object is accepted too). The text before ``[TOOL_CALLS]`` (and any after the list) is the content. A call keeps
    the ``id`` the model wrote. Registered as tool parser ``mistral``."""

    TOKEN = "[TOOL_CALLS]"

    def parse(self, text: str) -> list[ToolCall]:
        return self._split(text)[1]

    def content(self, text: str) -> str:
        return self._split(text)[0]

    def _split(self, text: str) -> tuple[str, list[ToolCall]]:
        calls, parts = [], []
        pos = 0
        while True:
            at = text.find(self.TOKEN, pos)
            if at < 0:
                parts.append(text[pos:])
                break
            parts.append(text[pos:at])
            pos = at + len(self.TOKEN)
            while pos < len(text) and text[pos].isspace():
                pos += 1
            try:
                obj, pos = decode_json(text, pos)
            except json.JSONDecodeError as exc:
                calls.append(ToolCall("", {}, error=f"the tool calls after {self.TOKEN} are not valid JSON ({exc.msg} "
                                                     f"at line {exc.lineno} column {exc.colno}); {_EXPECTED}"))
                nxt = text.find(self.TOKEN, pos)
                pos = len(text) if nxt < 0 else nxt
                continue
            calls += [_call(item) for item in (obj if isinstance(obj, list) else [obj])]
        return " ".join(p.strip() for p in parts if p.strip()), calls


def _call(obj: Any) -> ToolCall:
    return call_from_object(obj, _EXPECTED, id_key="id")


MISTRAL_V3 = ChatFormat(
    name="mistral_v3",
    description="Mistral instruct v3 (7B-v0.3, Mixtral-8x22B, Large-2407): [TOOL_CALLS] JSON lists with "
                "9-character ids",
    end_of_turn=("</s>",),
    tool_parser="mistral",
    tool_call_id="alnum9",
    template="mistral_v3",
    identify=("<s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
              "[/TOOL_RESULTS]"),
    template_markers=("[AVAILABLE_TOOLS] [", "[TOOL_RESULTS] {"),
    differs_from_deployment="puts the tool list and the system prompt with the first user message (mistral-common and "
                            "the published template put them with the last one, so every new user message rewrote the "
                            "history), renders a string tool result as a JSON string (mistral-common decodes one that "
                            "is JSON; the published template writes it unquoted), keeps an assistant's content before "
                            "its calls, and does not check that roles alternate or that ids have nine characters",
)

FORMATS = (MISTRAL_V3,)
TOOL_PARSERS = {"mistral": MistralToolParser}
REASONING_PARSERS: dict = {}
