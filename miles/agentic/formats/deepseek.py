"""DeepSeek: DeepSeek-R1, DeepSeek-V3 and DeepSeek-V3.1 (one vocabulary, three chat formats).

Turns are ``<｜User｜>...`` and ``<｜Assistant｜>...<｜end▁of▁sentence｜>`` after ``<｜begin▁of▁sentence｜>`` and
the system prompt. Tool calls sit in one section at the end of the assistant turn:
``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>...<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``, where V3 and R1 write a
call as ``function<｜tool▁sep｜>NAME`` and the arguments in a fenced JSON block on the next lines (calls one per
line), and V3.1 as ``NAME<｜tool▁sep｜>ARGS`` (calls back to back). Results come back as
``<｜tool▁output▁begin｜>...<｜tool▁output▁end｜>``, inside ``<｜tool▁outputs▁begin｜>...<｜tool▁outputs▁end｜>`` for V3
and R1, and the model answers right after them (no new ``<｜Assistant｜>``). R1 reasons inside ``<think>`` opened
by the generation prompt; V3.1 reasons when its ``thinking`` template variable is on (``<think>`` after
``<｜Assistant｜>``), else its generation prompt closes the reasoning at once (``</think>``).

The three share a vocabulary, so only their tokenizers' own chat templates tell them apart
(``template_markers``); a tokenizer without the published template is ambiguous and needs ``chat_format`` set.
"""

from __future__ import annotations

import re

from miles.agentic.chat_format import ChatFormat, ThinkTagReasoning
from miles.agentic.tool_calls import set_arguments
from miles.agentic.types import ToolCall

EOS = "<｜end▁of▁sentence｜>"
CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
OUTPUTS_BEGIN, OUTPUTS_END = "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>"
OUTPUT_BEGIN, OUTPUT_END = "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"

# every DeepSeek chat format is a candidate for this vocabulary; R1 and V3.1 add the reasoning tags, so that
# without a published template to single one out, R1 and V3.1 tie (detection refuses to guess)
_TOKENS = ("<｜User｜>", "<｜Assistant｜>", CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP, OUTPUTS_BEGIN,
           OUTPUTS_END, OUTPUT_BEGIN, OUTPUT_END)
_THINK = ("<think>", "</think>")


class SectionToolParser:
    """Calls in one section, ``SECTION_BEGIN (CALL_BEGIN body CALL_END)* SECTION_END``, after the content.

    A subclass reads one call's body (:meth:`_read`). A call that is not closed, or calls outside a closed
    section, carry an ``error``; the content is the text outside the section.
    """

    section_begin: str
    section_end: str
    call_begin: str
    call_end: str

    def _section(self, text: str) -> tuple[int, int, int, int] | None:
        """Where the section is: ``(start, body_start, body_end, end)``; ``end`` is after its closing token, or
        the text's end when it is not closed (then ``body_end == end``). None when the text has no call."""
        starts = [i for i in (text.find(self.section_begin), text.find(self.call_begin)) if i >= 0]
        if not starts:
            return None
        start = min(starts)
        body_start = start + len(self.section_begin) if text.startswith(self.section_begin, start) else start
        close = text.find(self.section_end, body_start)
        if close < 0:
            return start, body_start, len(text), len(text)
        return start, body_start, close, close + len(self.section_end)

    def parse(self, text: str) -> list[ToolCall]:
        section = self._section(text)
        if section is None:
            return []
        start, body_start, body_end, end = section
        calls = []
        for piece in text[body_start:body_end].split(self.call_begin)[1:]:
            call = ToolCall(name="", arguments={})
            inner, closed, rest = piece.partition(self.call_end)
            self._read(inner, call)
            if not closed:
                call.error = call.error or f"the tool call is not closed with {self.call_end}"
            elif rest.strip():
                call.error = call.error or (f"unexpected text after the tool call: {rest.strip()[:80]!r}; expected "
                                            f"{self.call_begin} or {self.section_end}")
            calls.append(call)
        if not calls:
            calls.append(ToolCall(name="", arguments={}, error=f"the tool-call section holds no call "
                                                               f"({self.call_begin}...{self.call_end})"))
        problem = (f"the tool calls are not opened with {self.section_begin}" if body_start == start else
                   f"the tool-call section is not closed with {self.section_end}" if body_end == end else None)
        if problem:
            for call in calls:
                call.error = call.error or problem
        return calls

    def content(self, text: str) -> str:
        section = self._section(text)
        if section is None:
            return text.strip()
        start, _, _, end = section
        return (text[:start] + text[end:]).strip()

    def _read(self, body: str, call: ToolCall) -> None:
        raise NotImplementedError

    @staticmethod
    def _arguments(raw: str, call: ToolCall) -> None:
        set_arguments(call, raw)


class DeepSeekV3Parser(SectionToolParser):
    """DeepSeek-V3 and R1 calls:
    ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>``, one per line inside
    ``<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>``. Registered as tool parser ``deepseek_v3``."""

    section_begin, section_end, call_begin, call_end = CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END
    _FENCED = re.compile(r"\A[ \t]*```(?:json)?[ \t]*\n(.*)\n[ \t]*```\s*\Z", re.DOTALL)

    def _read(self, body: str, call: ToolCall) -> None:
        kind, sep, rest = body.partition(SEP)
        if not sep:
            call.error = (f"the tool call has no {SEP}; expected function{SEP}NAME, then the arguments in a "
                          f"```json block")
            return
        name, _, raw = rest.partition("\n")
        call.name = name.strip()
        if not call.name:
            call.error = f"the tool call names no function after {SEP}"
            return
        if kind.strip() not in ("function", ""):
            call.error = f"unknown tool call type {kind.strip()!r}; expected 'function'"
            return
        fenced = self._FENCED.match(raw)
        if fenced is None and raw.lstrip().startswith("```"):
            call.error = f"the arguments of {call.name} are not closed with ```"
            return
        self._arguments(fenced.group(1) if fenced else raw, call)


class DeepSeekV31Parser(SectionToolParser):
    """DeepSeek-V3.1 calls: ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>`` back to back inside
    ``<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>``. Registered as tool parser ``deepseek_v31``."""

    section_begin, section_end, call_begin, call_end = CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END

    def _read(self, body: str, call: ToolCall) -> None:
        name, sep, raw = body.partition(SEP)
        call.name = name.strip()
        if not sep:
            call.error = f"the tool call has no {SEP}; expected NAME{SEP}ARGUMENTS"
            return
        if not call.name:
            call.error = f"the tool call names no function before {SEP}"
            return
        self._arguments(raw, call)


DEEPSEEK_R1 = ChatFormat(
    name="deepseek_r1",
    description="DeepSeek-R1: the generation prompt opens <think>, tool calls in the DeepSeek-V3 form",
    end_of_turn=(EOS,),
    tool_parser="deepseek_v3",
    reasoning_parser="deepseek_r1",
    reasoning_field="reasoning_content",
    always_reasons=True,
    template="deepseek_r1",
    identify=(*_TOKENS, *_THINK),
    template_markers=("split('</think>')[-1]",),
    differs_from_deployment="keeps every turn's reasoning and opens <think> after tool results too, and lists the "
                            "tools in the system prompt; the published template strips the reasoning from every "
                            "turn, ignores the tools, and renders a second tool-call turn without its opening tokens",
)

DEEPSEEK_V3 = ChatFormat(
    name="deepseek_v3",
    description="DeepSeek-V3 (and V3-0324): tool calls as function<｜tool▁sep｜>NAME and a ```json block, results in "
                "<｜tool▁outputs▁begin｜>",
    end_of_turn=(EOS,),
    tool_parser="deepseek_v3",
    template="deepseek_v3",
    identify=_TOKENS,
    template_markers=(OUTPUTS_BEGIN, "```json"),
    differs_from_deployment="lists the tools in the system prompt (the published template ignores them) and "
                            "accepts arguments as a mapping as well as a JSON string; the turns render as published",
)

DEEPSEEK_V31 = ChatFormat(
    name="deepseek_v31",
    description="DeepSeek-V3.1 hybrid thinking: <think> after <｜Assistant｜> when `thinking` is on, "
                "</think> when off; tool calls as NAME<｜tool▁sep｜>ARGS",
    end_of_turn=(EOS,),
    tool_parser="deepseek_v31",
    reasoning_parser="deepseek_v31",
    reasoning_field="reasoning_content",
    template="deepseek_v31",
    identify=(*_TOKENS, *_THINK),
    template_markers=("<｜Assistant｜></think>",),
    template_kwargs={"thinking": True},
    differs_from_deployment="keeps every turn's reasoning (<think>REASONING</think>) with thinking on, which is the "
                            "default here, and lists the tools in the system prompt; the published template renders "
                            "every earlier turn as </think>CONTENT, thinks only when asked, and ignores the tools",
)

FORMATS = (DEEPSEEK_R1, DEEPSEEK_V3, DEEPSEEK_V31)
TOOL_PARSERS = {"deepseek_v3": DeepSeekV3Parser, "deepseek_v31": DeepSeekV31Parser}
REASONING_PARSERS = {
    "deepseek_r1": lambda: ThinkTagReasoning(opened_by_prompt=True),
    "deepseek_v31": lambda: ThinkTagReasoning(opened_by_prompt=True),
}
