"""Token-exact chat turns: the tokens of new messages are the suffix between two renderings of the
tokenizer's chat template, appended to the tokens the trajectory already holds.

The policy's own turns are never re-rendered into tokens: the trajectory keeps the generated ids.
The rendering of the conversation so far is only used to find where the new messages begin, right
after the end-of-turn token that closed the policy's last turn. A template that changes what it
rendered for earlier messages when new ones arrive (not append-only: e.g. one that strips reasoning
from old turns, or closes a group of tool results only after the last one) is detected and reported,
never silently re-tokenized.
"""

from __future__ import annotations

from typing import Any

from miles.agentic.types import Message

__all__ = ["Conversation", "NotAppendOnly", "end_of_turn", "normalize_messages"]


class NotAppendOnly(ValueError):
    """The chat template rendered earlier messages differently once new ones were added."""


def end_of_turn(tokenizer: Any) -> tuple[str, int]:
    """The token that ends a turn: ``<|im_end|>`` when the tokenizer has it (ChatML), else EOS."""
    for text in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>"):
        token_id = tokenizer.convert_tokens_to_ids(text)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
            return text, token_id
    return tokenizer.eos_token, tokenizer.eos_token_id


def normalize_messages(observation: Any, role: str) -> list[Message]:
    """An observation (messages, one message, a string, or None) as a list of messages; a string becomes
    one message with ``role``."""
    if observation is None:
        return []
    if isinstance(observation, str):
        return [{"role": role, "content": observation}]
    if isinstance(observation, dict):
        observation = [observation]
    if not isinstance(observation, list) or not all(isinstance(m, dict) and "role" in m for m in observation):
        raise TypeError(f"an observation must be chat messages (dicts with 'role'), one message, a string or None; "
                        f"got {type(observation).__name__}: {str(observation)[:200]}")
    return [dict(m) for m in observation]


class Conversation:
    """The messages of one trajectory and how they map to tokens.

    ``prompt_ids`` is the rendering of the first messages with the generation prompt. After each policy
    turn, :meth:`add_policy_turn` records the message that the generated tokens stand for, and
    :meth:`extend` returns the tokens of the next messages plus the next generation prompt.
    """

    def __init__(self, tokenizer: Any, messages: list[Message], tools: list[dict[str, Any]] | None = None) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template; multi-turn rollouts render messages with one "
                             "(set model.tokenizer.chat_template, e.g. chatml_tools, for a built tokenizer)")
        self.tokenizer, self.tools = tokenizer, tools or None
        self.messages: list[Message] = list(messages)
        self.eot_text, self.eot_id = end_of_turn(tokenizer)
        self.prompt_ids = self.encode(self.render(self.messages, generation_prompt=True))

    def render(self, messages: list[Message], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def add_policy_turn(self, message: Message) -> None:
        """Record the assistant message a generated turn stands for (its tokens stay as generated)."""
        self.messages.append(message)

    def extend(self, new_messages: list[Message], generation_prompt: bool = True) -> list[int]:
        """The tokens of ``new_messages`` (and the generation prompt), to follow the policy's last turn.

        Raises :class:`NotAppendOnly` when the template renders the conversation so far differently once
        ``new_messages`` follow it.
        """
        before = self.render(self.messages, generation_prompt=False)
        after = self.render(self.messages + new_messages, generation_prompt=generation_prompt)
        if not after.startswith(before):
            at = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
            raise NotAppendOnly(
                f"the chat template is not append-only for this turn: adding {len(new_messages)} message(s) "
                f"({', '.join(m['role'] for m in new_messages)}) changed the rendering of the earlier ones at "
                f"character {at}: {before[max(0, at - 40):at + 40]!r} became {after[max(0, at - 40):at + 40]!r}"
            )
        # The new tokens start right after the end-of-turn token that closed the last policy turn (what the
        # template puts after it, e.g. a newline, belongs to the new tokens: the policy never generated it).
        start = len(before)
        if self.messages and self.messages[-1].get("role") == "assistant":
            end = before.rfind(self.eot_text)
            if end >= 0:
                start = end + len(self.eot_text)
        self.messages.extend(new_messages)
        return self.encode(after[start:])
