"""Token-exact chat turns with the shipped ChatML tool template and the char tokenizer."""

import pytest

from miles.agentic.chat import Conversation, NotAppendOnly
from miles.agentic.chat_format import for_tokenizer
from miles.models.hf import build_char_tokenizer, read_chat_template
from miles.testing import CHAT_ALPHABET, CHAT_TOKENIZER

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer(CHAT_ALPHABET, **CHAT_TOKENIZER)


def _policy_turn(tokenizer, conversation, message):
    """The tokens a policy would generate for ``message``: its rendering inside the template, up to and
    including the end-of-turn token."""
    before = conversation.render(conversation.messages, generation_prompt=True)
    after = conversation.render(conversation.messages + [message], generation_prompt=False)
    body = after[len(before): after.rindex(conversation.eot_text)]
    return tokenizer.encode(body, add_special_tokens=False) + [conversation.eot_id]


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_turn_tokens_equal_one_rendering_of_the_whole_conversation(tokenizer, tools):
    """Prompt + generated turns + observation suffixes == the template's rendering of everything, including
    two tool results in one turn (they share one user turn in this template)."""
    conversation = Conversation(tokenizer, [{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "What is 2+3 and 4+5?"}], tools)
    tokens = list(conversation.prompt_ids)
    call = {"role": "assistant", "content": "Let me add.", "tool_calls": [
        {"id": "c0", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}},
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 4, "b": 5}}}]}
    tokens += _policy_turn(tokenizer, conversation, call)
    conversation.add_policy_turn(call)
    results = [{"role": "tool", "tool_call_id": "c0", "content": "5"},
               {"role": "tool", "tool_call_id": "c1", "content": "9"}]
    observation = conversation.extend(results)
    tokens += observation
    answer = {"role": "assistant", "content": "5 and 9"}
    tokens += _policy_turn(tokenizer, conversation, answer)
    conversation.add_policy_turn(answer)
    tokens += conversation.extend([{"role": "user", "content": "Thanks!"}])

    whole = conversation.render(conversation.messages, generation_prompt=True)
    assert tokens == tokenizer.encode(whole, add_special_tokens=False)
    text = tokenizer.decode(observation)
    assert text == ("\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n9\n</tool_response>"
                    "<|im_end|>\n<|im_start|>assistant\n")
    assert ('"name": "add"' in tokenizer.decode(conversation.prompt_ids)) == (tools is not None)


def test_tool_results_added_one_at_a_time_are_refused_not_retokenized(tokenizer):
    """Consecutive tool results share one user turn: adding the second after the first was closed would
    rewrite the first's closing tokens, so the template is not append-only for that turn."""
    conversation = Conversation(tokenizer, [{"role": "user", "content": "hi"}], TOOLS)
    conversation.add_policy_turn({"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}] * 2})
    conversation.extend([{"role": "tool", "content": "3"}], generation_prompt=False)
    with pytest.raises(NotAppendOnly, match=r"not append-only .* 1 message\(s\) \(tool\)"):
        conversation.extend([{"role": "tool", "content": "3"}])


def test_a_template_that_rewrites_earlier_turns_is_detected(tokenizer):
    """A template that drops the content of earlier assistant turns (as reasoning templates do) fails loudly."""
    tokenizer = build_char_tokenizer(CHAT_ALPHABET, **CHAT_TOKENIZER)
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' and not loop.last %}...{% else %}{{ m.content }}{% endif %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    conversation = Conversation(tokenizer, [{"role": "user", "content": "hi"}])
    conversation.add_policy_turn({"role": "assistant", "content": "hello"})
    with pytest.raises(NotAppendOnly, match=r"after policy turn 1 changed the rendering of message 1 \(assistant, "
                                            r"as the policy generated it\) at token 21: 'h' became '\.'") as caught:
        conversation.extend([{"role": "user", "content": "again"}])
    assert (caught.value.message_index, caught.value.token_index) == (1, 21)


def test_end_of_turn_and_template_lookup(tokenizer):
    fmt = for_tokenizer(tokenizer)
    assert fmt.name == "chatml" and fmt.end_of_turn_ids == {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    plain = build_char_tokenizer("abc", chat_template="chatml_tools")
    assert for_tokenizer(plain).format.end_of_turn == ("<eos>",)  # no builtin fits: turns end at EOS
    plain = build_char_tokenizer("abc")
    with pytest.raises(ValueError, match="no chat template"):
        Conversation(plain, [{"role": "user", "content": "a"}])
    with pytest.raises(Exception, match="neither a file nor a shipped template .*chatml_tools"):
        read_chat_template("no-such-template")


def test_every_character_is_its_own_token_newlines_included(tokenizer):
    ids = tokenizer.encode("a\n\n\nb", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids) == ["a", "\n", "\n", "\n", "b"]
