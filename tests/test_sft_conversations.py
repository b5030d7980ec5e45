"""SFT on multi-turn conversations (``sft.messages_key``): the sample holds the tokens of the template's rendering
of the whole conversation, the assistant turns (and their end-of-turn token) alone trained."""

from __future__ import annotations

import pytest

from miles.agentic.chat import NotAppendOnly
from miles.loop.sft import conversation_sample
from miles.models.hf import load_tokenizer
from miles.rollout.data_source import Prompt
from miles.testing import build_chat_model

CONVERSATION = [{"role": "user", "content": "count down from 2"}, {"role": "assistant", "content": "2"},
                {"role": "user", "content": "say 1"}, {"role": "assistant", "content": "1"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(str(build_chat_model(tmp_path_factory.mktemp("sft-chat") / "model")))


def sample_of(tokenizer, messages):
    prompt = Prompt(index=0, prompt="count down from 2", prompt_ids=[], label="2", extra={})
    return conversation_sample(prompt, tokenizer, messages)


@pytest.mark.parametrize("messages", [CONVERSATION[1:], CONVERSATION], ids=["after-the-prompt", "whole"])
def test_a_conversation_is_the_templates_rendering_with_the_assistant_turns_trained(tokenizer, messages):
    """The column may hold the conversation after the prompt or the whole conversation (as chat datasets do):
    both are the template's rendering of the whole conversation, token for token, up to the last end of turn."""
    sample = sample_of(tokenizer, messages)
    rendered = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    text = tokenizer.decode(sample.prompt_ids + sample.response_ids, skip_special_tokens=False)
    assert rendered.startswith(text) and rendered[len(text):] == "\n"  # the newline after the last end of turn
    trained = "".join(tokenizer.decode([t], skip_special_tokens=False)
                      for t, m in zip(sample.response_ids, sample.loss_mask, strict=True) if m)
    assert trained == "2<|im_end|>1<|im_end|>"


def test_a_conversation_that_does_not_follow_the_prompt_is_refused(tokenizer):
    """A first user message other than the prompt's would follow the prompt's generation prompt: not a
    conversation the policy could have had, so the row is refused rather than trained on."""
    with pytest.raises(NotAppendOnly, match="message 0 \\(user\\)"):
        sample_of(tokenizer, [{"role": "user", "content": "count down from 3"}, *CONVERSATION[1:]])
