"""Reading one generated policy turn in its chat format: the text an env sees, the reasoning, the tool
calls (checked against the tools' schemas, with the format's ids) and the assistant message the turn
stands for when the conversation is rendered again."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from miles.agentic.chat_format import BoundFormat, assistant_message
from miles.agentic.tool_calls import CheckedCalls, check_calls
from miles.agentic.types import Message, ToolCall
from miles.hookspecs import TurnLayout

__all__ = ["PolicyTurn", "read_turn", "turn_source", "message_parts"]


@dataclass
class PolicyTurn:
    text: str  # the turn decoded without special tokens (what an env reads as the action's text)
    answer: str  # the text without its reasoning (what a reward scores as the response)
    reasoning: str | None  # what the reasoning parser found (None: no reasoning in this turn)
    checked: CheckedCalls  # every call found, the unusable ones with their error
    message: Message  # the assistant message, in the shape the format's template reads


def turn_source(fmt: BoundFormat, token_ids: list[int]) -> str:
    """What the parsers read of a generated turn: its text with special tokens (some families write calls in
    them), less the stop token it ended with."""
    ids = token_ids[:-1] if token_ids and token_ids[-1] in fmt.stop_ids else token_ids
    return fmt.tokenizer.decode(ids, skip_special_tokens=False)


def read_turn(fmt: BoundFormat, token_ids: list[int], tools: list[dict[str, Any]] | None, *, tool_parser: Any = None,
              first_call_index: int = 0, seed: str = "") -> PolicyTurn:
    """Read a generated turn. ``tool_parser`` overrides the format's; calls the text gives no id get
    ``fmt.format.call_id(first_call_index + i, ...)``. Without ``tools`` no call is parsed."""
    tokenizer = fmt.tokenizer
    raw = turn_source(fmt, token_ids)
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    reasoning, body, answer = None, raw, text
    if fmt.reasoning_parser is not None:
        split = fmt.reasoning_parser.split(raw)
        reasoning = split.reasoning
        if reasoning is not None:
            answer = _without_special_tokens(tokenizer, split.content)
        if fmt.format.reasoning_field:
            body = split.content
    parser = tool_parser or fmt.tool_parser
    parsed = parser.parse(body) if tools and parser is not None else []
    content, calls = message_parts(parser, body, parsed)
    checked = check_calls(parsed, tools) if tools and parser is not None else CheckedCalls([])
    if layout(parser) == "markup":  # what the turn says is its content: the markup around it is the family's
        answer = _without_special_tokens(tokenizer, content)
    for i, call in enumerate(checked.calls):
        if not call.id:
            call.id = fmt.format.call_id(first_call_index + i, call.name, seed)
    return PolicyTurn(text, answer, reasoning, checked, assistant_message(fmt.format, content, reasoning, calls))


def layout(parser: Any) -> str:
    """A tool parser's :class:`~miles.hookspecs.TurnLayout` (``calls`` unless it says otherwise)."""
    return parser.turn_layout if isinstance(parser, TurnLayout) else "calls"


def message_parts(parser: Any, body: str, parsed: list[ToolCall]) -> tuple[str, list[ToolCall]]:
    """The content and the calls of the assistant message a turn (``body``: its text, reasoning apart) stands for:
    what a deployed server hands back for it, and what the template renders in the history, so that the rendering is
    the text as generated. A turn with a call that cannot be read is all text (no call of it is taken); a call the
    tools refuse (an unknown tool, arguments off their schema) is a call all the same (the env answers it with the
    error). ``parsed``: what ``parser`` read of ``body`` (empty without tools), before the tools checked them."""
    kind = layout(parser)
    unreadable = any(c.error is not None for c in parsed)  # before the tools check them: a parse error
    if kind == "markup":
        return parser.content(body), [c for c in parsed if c.error is None]
    if kind == "inline" or not parsed or unreadable:
        return body, []
    return parser.content(body), parsed


def _without_special_tokens(tokenizer: Any, text: str) -> str:
    for token in tokenizer.all_special_tokens:
        text = text.replace(token, "")
    return text
