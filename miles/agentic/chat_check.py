"""The scenario matrix behind ``miles chat-format check``: is a chat format token-exact?

Each scenario is a conversation (system and user, one tool call and its result, two calls in one turn
and their two results, reasoning on and off, a follow-up user message, a final answer). It is played
as a multi-turn rollout plays it, through the same :class:`~miles.agentic.chat.Conversation`: the prompt rendered
with the generation prompt, each assistant turn generated as the model emits it (its family's training template's
rendering of the message as the latest turn, up to the stop token: what a model of that family produces, whatever
template renders the conversation), each observation as the suffix. The result is exact when no rendering, at any
turn or of the finished conversation, differs from the tokens the trajectory holds, and when each turn's calls and
reasoning parse back to the message they came from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from miles.agentic.chat import Conversation, NotAppendOnly
from miles.agentic.chat_format import BoundFormat, ChatFormat
from miles.agentic.types import Message

__all__ = ["SCENARIOS", "ScenarioResult", "check_format", "scenario_messages", "TOOLS"]

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The time in a time zone.",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}},
]

SCENARIOS = ("one_call", "parallel_calls", "reasoning", "reasoning_off", "follow_up_user", "final_answer")


def _assistant(fmt: ChatFormat, content: str, calls: list[tuple[str, dict]] = (), reasoning: str | None = None,
               first_index: int = 0) -> Message:
    from miles.agentic.types import ToolCall

    parsed = [ToolCall(name, args, id=fmt.call_id(first_index + i, name, seed="check"))
              for i, (name, args) in enumerate(calls)]
    message: Message = {"role": "assistant", "content": content}
    if reasoning is not None and fmt.reasoning_field:
        message[fmt.reasoning_field] = reasoning
    elif reasoning is not None and fmt.reasoning_parser:  # a family that keeps reasoning in the content
        message["content"] = f"<think>\n{reasoning}\n</think>\n\n{content}"
    if parsed:
        message["tool_calls"] = [fmt.message_call(c) for c in parsed]
    return message


def _tool(message: Message, index: int, content: str) -> Message:
    call = message["tool_calls"][index]
    return {"role": "tool", "tool_call_id": call["id"], "name": call["function"]["name"], "content": content}


def scenario_messages(fmt: ChatFormat, name: str, reasoning: bool = True) -> list[Message]:
    """The messages of scenario ``name`` for ``fmt`` (call ids and argument form as the format wants);
    ``reasoning=False``: thinking is off (the template's kwargs), no turn reasons."""
    thinks = fmt.reasoning_parser is not None and reasoning
    why = "I should look this up." if thinks else None
    messages = _scenario(fmt, name, thinks, why)
    if fmt.one_call_per_turn:
        messages = _one_call_per_turn(messages)
    if fmt.always_reasons and thinks:  # the generation prompt opens the reasoning: every turn has some
        messages = [_with_reasoning(fmt, m) for m in messages]
    return messages


def _one_call_per_turn(messages: list[Message]) -> list[Message]:
    """A turn with several calls played as the family plays it: one call, its result, the next call, ..."""
    out: list[Message] = []
    i = 0
    while i < len(messages):
        message = messages[i]
        calls = message.get("tool_calls") or []
        if message["role"] != "assistant" or len(calls) < 2:
            out.append(message)
            i += 1
            continue
        results = messages[i + 1:i + 1 + len(calls)]
        for j, (call, result) in enumerate(zip(calls, results)):
            turn = {k: v for k, v in message.items() if k != "tool_calls" and (j == 0 or k == "role")}
            out += [{**turn, "content": message["content"] if j == 0 else "", "tool_calls": [call]}, result]
        i += 1 + len(calls)
    return out


def _with_reasoning(fmt: ChatFormat, message: Message) -> Message:
    if message["role"] != "assistant" or message.get(fmt.reasoning_field or ""):
        return message
    return {**message, fmt.reasoning_field: "Let me think."} if fmt.reasoning_field else message


def _scenario(fmt: ChatFormat, name: str, thinks: bool, why: str | None) -> list[Message]:
    head: list[Message] = [{"role": "system", "content": "You are a helpful assistant."},
                           {"role": "user", "content": "What is the weather in Paris?"}]
    if name == "final_answer":
        return [*head, _assistant(fmt, "It is sunny in Paris.", reasoning=why)]
    if name == "one_call":
        call = _assistant(fmt, "", [("get_weather", {"city": "Paris"})])
        return [*head, call, _tool(call, 0, "sunny, 21 C"), _assistant(fmt, "It is sunny in Paris, 21 C.")]
    if name in ("parallel_calls", "reasoning", "reasoning_off"):
        if name != "reasoning_off" or thinks:
            reason = why if name == "reasoning" else None
            calls = _assistant(fmt, "", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris"})],
                               reasoning=reason)
            final = _assistant(fmt, "Sunny, and it is noon.", reasoning="Both answers are in." if reason else None)
            if name == "reasoning_off":  # reasoning in the first turn, none in the answer
                calls = _assistant(fmt, "", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris"})],
                                   reasoning=why)
                final = _assistant(fmt, "Sunny, and it is noon.")
            return [*head, calls, _tool(calls, 0, "sunny"), _tool(calls, 1, "12:00"), final]
        return []
    if name == "follow_up_user":
        call = _assistant(fmt, "", [("get_weather", {"city": "Paris"})], reasoning=why)
        return [*head, call, _tool(call, 0, "sunny"), _assistant(fmt, "It is sunny.", reasoning=why),
                {"role": "user", "content": "And in Rome?"},
                _assistant(fmt, "", [("get_weather", {"city": "Rome"})], reasoning=why, first_index=1)]
    raise ValueError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")


@dataclass
class ScenarioResult:
    scenario: str
    exact: bool
    detail: str = ""  # for a mismatch: the first differing token and both renderings around it
    parse_problems: list[str] = field(default_factory=list)
    skipped: str = ""  # why the scenario does not apply to this format

    @property
    def ok(self) -> bool:
        return bool(self.skipped) or (self.exact and not self.parse_problems)


def _first_stop(fmt: BoundFormat, text: str, start: int) -> int:
    """The end (exclusive) of the first stop token in ``text`` at or after ``start``, else ``len(text)``."""
    ends = [text.find(t, start) + len(t) for t in fmt.format.all_stop_tokens if text.find(t, start) >= 0]
    return min(ends) if ends else len(text)


def _strip_stop(fmt: BoundFormat, text: str) -> str:
    for token in sorted(fmt.format.all_stop_tokens, key=len, reverse=True):
        if text.endswith(token):
            return text[: -len(token)]
    return text


def play(fmt: BoundFormat, messages: list[Message], tools: list[dict[str, Any]] | None,
         model: BoundFormat | None = None) -> tuple[list[int], list[str], list[str]]:
    """The ids a rollout records for ``messages`` rendered by ``fmt``, the generated text of each assistant turn, and
    problems parsing those turns back. ``model``: the format whose template renders what the model generates (its
    family's training template; default ``fmt``). Raises NotAppendOnly where ``fmt``'s rendering differs from the
    trajectory's tokens, at a turn or at the end."""
    model = model or fmt
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    conversation = Conversation(fmt, messages[:first], tools)
    ids, generated, problems = list(conversation.prompt_ids), [], []
    k = first
    while k < len(messages):
        text = _generated(model, messages[:k + 1], tools)
        turn_ids = conversation.encode(text)
        generated.append(text)
        ids += turn_ids
        problems += _parse_back(fmt, _strip_stop(fmt, text), messages[k], k)
        conversation.add_policy_turn(messages[k], turn_ids)
        nxt = next((i for i in range(k + 1, len(messages)) if messages[i]["role"] == "assistant"), len(messages))
        if k + 1 < len(messages):
            ids += conversation.extend(messages[k + 1:nxt], generation_prompt=nxt < len(messages))
        k = nxt
    problem = conversation.finish()
    if problem is not None:
        raise problem
    return ids, generated, problems


def _generated(model: BoundFormat, messages: list[Message], tools: list[dict[str, Any]] | None) -> str:
    """What a model of ``model``'s family generates for the last of ``messages``: the template's rendering of it
    after the generation prompt, up to and including its first stop token."""
    conversation = Conversation(model, messages[:-1], tools)
    prompt = conversation.render(messages[:-1], generation_prompt=True)
    whole = conversation.render(messages, generation_prompt=False)
    if not whole.startswith(prompt):
        at = next((i for i, (a, b) in enumerate(zip(prompt, whole)) if a != b), len(prompt))
        raise NotAppendOnly(f"the generation prompt before message {len(messages) - 1} is not a prefix of the "
                            f"rendering with that message at character {at}: {prompt[at - 30:at + 30]!r} vs "
                            f"{whole[at - 30:at + 30]!r}", message_index=len(messages) - 1)
    return whole[len(prompt):_first_stop(model, whole, len(prompt))]


def _parse_back(fmt: BoundFormat, text: str, message: Message, index: int) -> list[str]:
    problems = []
    if fmt.reasoning_parser is not None and fmt.format.reasoning_field:
        split = fmt.reasoning_parser.split(text)
        want = message.get(fmt.format.reasoning_field) or None
        if (split.reasoning or None) != want:
            problems.append(f"message {index}: reasoning parsed as {split.reasoning!r}, expected {want!r}")
        text = split.content
    if fmt.tool_parser is not None:
        calls = fmt.tool_parser.parse(text)
        got = [(c.name, c.arguments, c.error) for c in calls]
        want = [(c["function"]["name"], _arguments(c["function"]["arguments"]), None)
                for c in message.get("tool_calls") or ()]
        if got != want:
            problems.append(f"message {index}: tool calls parsed as {got}, expected {want}")
        content = fmt.tool_parser.content(text)
        if content.strip() != str(message.get("content") or "").strip() and fmt.format.reasoning_field:
            problems.append(f"message {index}: content parsed as {content!r}, expected {message.get('content')!r}")
    return problems


def _arguments(arguments: Any) -> Any:
    return json.loads(arguments) if isinstance(arguments, str) else arguments


def check_format(fmt: BoundFormat, scenarios: tuple[str, ...] = SCENARIOS,
                 model: BoundFormat | None = None) -> list[ScenarioResult]:
    """Play every scenario with ``fmt`` rendering and ``model``'s template generating (default: ``fmt``'s own)."""
    results = []
    off = fmt.template_kwargs.get("enable_thinking") is False or fmt.template_kwargs.get("thinking") is False
    for name in scenarios:
        messages = scenario_messages(fmt.format, name, reasoning=not off)
        if not messages:
            results.append(ScenarioResult(name, True, skipped="no reasoning: the format has none, or thinking is off"))
            continue
        try:
            _, _, problems = play(fmt, messages, TOOLS, model)
        except NotAppendOnly as exc:
            results.append(ScenarioResult(name, False, str(exc)))
            continue
        except Exception as exc:  # the template refused the conversation
            results.append(ScenarioResult(name, False, f"the template cannot render it: {type(exc).__name__}: {exc}"))
            continue
        results.append(ScenarioResult(name, True, parse_problems=problems))
    return results
