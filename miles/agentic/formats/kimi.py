"""Kimi: Kimi-K2 (Instruct).

Messages are ``<|im_system|>``, ``<|im_user|>`` or ``<|im_assistant|>``, the message's name (its role unless it
has a ``name``), ``<|im_middle|>``, the text and ``<|im_end|>``. Tool calls follow the content in one section,
``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>ARGS
<|tool_call_end|>...<|tool_calls_section_end|>``: the model writes each call's id itself, ``functions.NAME:INDEX``
with INDEX the call's position in the conversation, and a result names it back (``## Return of ID`` in a ``tool``
message). The tools are declared in a first system message, ``tool_declare``, as JSON.
"""

from __future__ import annotations

import re

from miles.agentic.chat_format import ChatFormat
from miles.agentic.formats.deepseek import SectionToolParser
from miles.agentic.types import ToolCall

ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"


class KimiK2Parser(SectionToolParser):
    """Kimi-K2 calls: ``<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>ARGS<|tool_call_end|>``
    inside ``<|tool_calls_section_begin|>...<|tool_calls_section_end|>``; the id is the header as written.
    Registered as tool parser ``kimi_k2``."""

    section_begin, section_end = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    call_begin, call_end = "<|tool_call_begin|>", "<|tool_call_end|>"
    _HEADER = re.compile(r"\A(?:functions\.)?(?P<name>.+?)(?::(?P<index>\d+))?\Z", re.DOTALL)

    def _read(self, body: str, call: ToolCall) -> None:
        header, sep, raw = body.partition(ARGUMENT_BEGIN)
        header = header.strip()
        match = self._HEADER.match(header)
        if match is None:
            call.error = f"the tool call names no function; expected functions.NAME:INDEX{ARGUMENT_BEGIN}ARGUMENTS"
            return
        call.name = match["name"]
        if match["index"] is not None:
            call.id = header  # the id the model wrote: results name it back
        if not sep:
            call.error = (f"the tool call has no {ARGUMENT_BEGIN}; expected "
                          f"functions.NAME:INDEX{ARGUMENT_BEGIN}ARGUMENTS")
            return
        self._arguments(raw, call)


KIMI_K2 = ChatFormat(
    name="kimi_k2",
    description="Kimi-K2 (Instruct): <|im_user|>/<|im_assistant|>/<|im_system|> messages, calls with ids "
                "functions.NAME:INDEX in a <|tool_calls_section_begin|> section",
    end_of_turn=("<|im_end|>",),
    tool_parser="kimi_k2",
    tool_call_id="functions.{name}:{index}",
    arguments="mapping",
    template="kimi_k2",
    identify=("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|tool_calls_section_begin|>",
              "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"),
    differs_from_deployment="puts no system prompt first when the conversation has none (set the `default_system` "
                            "template variable to do what the published template does, which puts Kimi's own) and "
                            "names a result's call by its position when the result has no tool_call_id; the turns "
                            "render as published",
)

FORMATS = (KIMI_K2,)
TOOL_PARSERS = {"kimi_k2": KimiK2Parser}
REASONING_PARSERS: dict = {}
