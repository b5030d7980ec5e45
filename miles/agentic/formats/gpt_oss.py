"""gpt-oss: OpenAI's harmony format.

Every message is ``<|start|>HEADER<|message|>BODY`` closed by ``<|end|>``; an assistant header names a channel
(``<|channel|>analysis``: reasoning, ``commentary``: calls and preambles, ``final``: the answer) and, for a call,
its recipient (``to=functions.NAME``, written after the channel or after the role) and ``<|constrain|>json``. In
one policy turn the model may write several messages (analysis, then a call or a final answer); it stops at
``<|call|>`` after a call, so calls come one turn each, and at ``<|return|>`` after a final answer. The training
template renders a final answer ending ``<|return|>`` in the history too (the token the policy generated), so
``<|end|>``, which closes the analysis inside a turn, is not a stop token. Tool results come back as
``<|start|>functions.NAME to=assistant<|channel|>commentary<|message|>OUTPUT<|end|>``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from miles.agentic.chat_format import ChatFormat, ReasoningSplit
from miles.agentic.tool_calls import set_arguments
from miles.agentic.types import ToolCall

__all__ = ["GPT_OSS", "HarmonyMessage", "HarmonyReasoning", "HarmonyToolParser", "harmony_messages"]

START, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|message|>", "<|channel|>", "<|constrain|>"
CLOSERS = ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_WORD = re.compile(r"\s*([^\s<]+)")


@dataclass
class HarmonyMessage:
    """One harmony message of a generated turn: where it lies in the text and what its header says."""

    start: int
    end: int  # after its closing token (or where the next message or the text starts/ends)
    header: str
    body: str | None  # None: the header never reached <|message|>
    channel: str = ""
    recipient: str = ""
    content_type: str = ""
    closer: str = ""  # the token that closed it, "" when the text ended first


def harmony_messages(text: str) -> list[HarmonyMessage]:
    """The messages of a generated turn's text (decoded with special tokens). The first may lack ``<|start|>`` and
    its role (the generation prompt holds them); the last may lack its closing token (stripped or cut)."""
    messages, pos = [], 0
    while pos < len(text):
        start = pos
        if text.startswith(START, pos):
            pos += len(START)
        nxt = text.find(START, pos)
        limit = len(text) if nxt < 0 else nxt
        at = text.find(MESSAGE, pos, limit)
        if at < 0:
            messages.append(HarmonyMessage(start, limit, text[pos:limit], None, **_header_fields(text[pos:limit])))
            pos = limit
            continue
        header, body_start = text[pos:at], at + len(MESSAGE)
        ends = [(i, c) for c in CLOSERS if (i := text.find(c, body_start, limit)) >= 0]
        if ends:
            close, closer = min(ends)
            end = close + len(closer)
        else:
            close, closer, end = limit, "", limit
        messages.append(HarmonyMessage(start, end, header, text[body_start:close], closer=closer,
                                       **_header_fields(header)))
        pos = end
    return messages


def _header_fields(header: str) -> dict[str, str]:
    fields = {"channel": "", "recipient": "", "content_type": ""}
    recipient = _RECIPIENT.search(header)
    if recipient:
        fields["recipient"] = recipient.group(1)
    if CHANNEL in header:
        after = _RECIPIENT.sub("", header.split(CHANNEL, 1)[1].split(CONSTRAIN, 1)[0])
        words = after.split()
        if words:
            fields["channel"] = words[0]
        if len(words) > 1:  # "commentary json": the content type written after the channel
            fields["content_type"] = words[1]
    if CONSTRAIN in header:
        word = _WORD.match(header.split(CONSTRAIN, 1)[1])
        if word:
            fields["content_type"] = word.group(1)
    return fields


def _is_reasoning(message: HarmonyMessage) -> bool:
    return message.channel == "analysis" and not message.recipient and message.body is not None


class HarmonyReasoning:
    """Reasoning on the analysis channel: the bodies of a turn's analysis messages (those without a recipient,
    joined by a newline) are the reasoning; the rest of the text, those messages cut out, goes to the tool parser.
    Registered as reasoning parser ``harmony``."""

    def split(self, text: str) -> ReasoningSplit:
        messages = harmony_messages(text)
        analysis = [m for m in messages if _is_reasoning(m)]
        if not analysis:
            return ReasoningSplit(None, text)
        rest, pos = [], 0
        for m in analysis:
            rest.append(text[pos:m.start])
            pos = m.end
        rest.append(text[pos:])
        return ReasoningSplit("\n".join(m.body for m in analysis), "".join(rest))


class HarmonyToolParser:
    """Harmony calls: a message with a recipient (``to=functions.NAME``; the ``functions.`` namespace is dropped
    from the name) whose body is the JSON arguments. The content is the text of the final-channel messages and of
    commentary messages without a recipient (preambles); a text without harmony messages is content as it is.
    Registered as tool parser ``harmony``."""

    def parse(self, text: str) -> list[ToolCall]:
        calls = []
        for message in harmony_messages(text):
            if not message.recipient or message.recipient == "assistant":
                continue
            name = message.recipient.removeprefix("functions.")
            call = ToolCall(name, {})
            if message.body is None:
                call.error = f"the call to {message.recipient} has no <|message|> with its arguments"
            else:
                set_arguments(call, message.body)
            calls.append(call)
        return calls

    turn_layout = "markup"  # a turn's content is its final-channel text, tools offered or not

    def content(self, text: str) -> str:
        messages = harmony_messages(text)
        if not any(m.body is not None for m in messages):
            return text.strip()
        parts = [m.body for m in messages if m.body is not None and not m.recipient
                 and m.channel in ("final", "commentary", "")]
        return "\n".join(p.strip() for p in parts if p.strip())


GPT_OSS = ChatFormat(
    name="gpt_oss",
    description="gpt-oss (harmony): analysis/commentary/final channels, calls to=functions.NAME ending <|call|>",
    end_of_turn=("<|return|>", "<|call|>"),
    tool_parser="harmony",
    reasoning_parser="harmony",
    reasoning_field="thinking",
    one_call_per_turn=True,
    template="gpt_oss",
    identify=("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>"),
    template_kwargs={"reasoning_effort": "medium"},
    differs_from_deployment="keeps every turn's analysis (the published template drops it once a final answer "
                            "follows), renders every call of a message (it renders only the first), ends a final "
                            "answer in the history with <|return|>, the token the model generated (it rewrites earlier "
                            "ones to <|end|>), writes tool results and string arguments as they are (it JSON-quotes "
                            "them), puts the recipient after the channel and ends a parameter line with its default "
                            "comment as harmony's own renderer does, and omits the current date unless current_date "
                            "is set (it uses today's date)",
)

FORMATS = (GPT_OSS,)
TOOL_PARSERS = {"harmony": HarmonyToolParser}
REASONING_PARSERS = {"harmony": HarmonyReasoning}
