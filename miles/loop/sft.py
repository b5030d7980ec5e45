"""The SFT step: prompt/label pairs, or multi-turn conversations rendered as the rollouts record them."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from miles import interrupts
from miles.errors import DataError
from miles.rollout.data_source import Prompt, PromptSource
from miles.types import Sample, SampleStatus, TrainBatch

__all__ = ["conversation_sample", "sft_samples", "sft_step"]


def sft_samples(prompts: list[Prompt], tokenizer: Any, messages_key: str | None = None,
                chat_format: Any = None) -> list[Sample]:
    """Prompt/label pairs as samples whose response is the label followed by EOS; with ``messages_key``,
    the conversation in that column of each row instead (:func:`conversation_sample`, rendered in
    ``chat_format`` when given, else in the builtin format the tokenizer speaks)."""
    if messages_key:
        return [conversation_sample(p, chat_format or tokenizer, p.extra.get(messages_key), messages_key)
                for p in prompts]
    samples = []
    for prompt in prompts:
        sample = Sample(prompt_ids=list(prompt.prompt_ids), prompt=prompt.prompt, label=prompt.label, reward=0.0,
                        images=list(prompt.images))
        label_ids = tokenizer(str(prompt.label), add_special_tokens=False)["input_ids"]
        sample.append([*label_ids, tokenizer.eos_token_id], None, from_policy=True)
        sample.status = SampleStatus.COMPLETED
        samples.append(sample)
    return samples


def conversation_sample(prompt: Prompt, tokenizer: Any, messages: Any, key: str = "messages") -> Sample:
    """A multi-turn SFT sample, token for token as ``multi_turn`` would record it: the prompt through the
    chat template, each assistant message's ``content`` as the exact text the policy generates (tool calls
    written inline, as the tool parser reads them) plus the end-of-turn token (loss mask 1), the other
    messages as the template's suffix (loss mask 0). ``messages`` is the conversation after the prompt; one that
    starts with the prompt's own messages (the whole conversation, as chat datasets hold it) starts after them."""
    from miles.agentic.chat import Conversation, normalize_messages

    if not isinstance(messages, list) or not messages:
        raise DataError(f"row {prompt.index}: sft.messages_key {key!r} must hold a non-empty list of messages")
    first = normalize_messages(prompt.prompt, role="user")
    conversation = Conversation(tokenizer, first)
    sample = Sample(prompt_ids=list(conversation.prompt_ids), prompt=prompt.prompt, label=prompt.label, reward=0.0)
    if [_said(m) for m in messages[:len(first)]] == [_said(m) for m in first]:
        messages = messages[len(first):]
    pending: list[dict] = []
    for message in messages:
        if message.get("role") != "assistant":
            pending.append(message)
            continue
        if pending:
            sample.append(conversation.extend(pending), None, from_policy=False)
            pending = []
        text = str(message.get("content") or "")
        turn = conversation.encode(text) + [conversation.eot_id]
        sample.append(turn, None, from_policy=True)
        conversation.add_policy_turn({"role": "assistant", "content": text}, turn)
    sample.status = SampleStatus.COMPLETED
    return sample


def _said(message: Any) -> tuple[Any, str] | None:
    """Who said what in ``message``: its role and text content."""
    return (message.get("role"), str(message.get("content") or "")) if isinstance(message, dict) else None


def sft_step(data: PromptSource, tokenizer: Any, batch_size: int, backend: Any, loss_fn: Callable, pad_token_id: int,
             messages_key: str | None = None, chat_format: Any = None) -> dict[str, float]:
    start = time.perf_counter()
    batch = TrainBatch.from_samples(sft_samples(data.next(batch_size), tokenizer, messages_key, chat_format),
                                    pad_token_id)
    metrics = backend.train_step(batch, loss_fn)
    metrics["time/step_s"] = time.perf_counter() - start
    interrupts.check()
    return metrics
