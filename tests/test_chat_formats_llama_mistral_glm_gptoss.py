"""The llama3, mistral_v3, glm45 and gpt_oss chat formats on Qwen's real BPE vocabulary (their own special tokens
added): the scenario matrix, calls and reasoning parsed back from rendered turns, malformed calls, Mistral's
ids, GLM's next-role boundary, and detection from each family's special tokens."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from miles.agentic.chat import Conversation, NotAppendOnly
from miles.agentic.chat_check import TOOLS, check_format
from miles.agentic.chat_format import bind, detect, is_alnum9
from miles.agentic.formats import glm, gpt_oss, llama, mistral
from miles.agentic.types import ToolCall
from miles.plugins import build_plugin_manager
from miles.registry import Registry
from miles.models.vocabularies import build_bpe_tokenizer

NAMES = ("llama3", "mistral_v3", "glm45", "gpt_oss")
HEAD = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the weather in Paris?"}]
RICH = {"city": "São Paulo", "days": 3, "units": {"temp": "C"}, "hours": [9, 12], "exact": True, "note": None}


@pytest.fixture(scope="module")
def registry():
    return Registry.from_plugin_manager(build_plugin_manager())


@pytest.fixture(scope="module")
def bound(registry):
    """Every format bound to one Qwen tokenizer that has all four formats' tokens."""
    formats = {name: registry.get("chat_format", name).obj for name in NAMES}
    tokens = [t for f in formats.values() for t in (*f.all_stop_tokens, *f.identify)]
    tokenizer = build_bpe_tokenizer("qwen", tokens)
    build = lambda kind, name: registry.build(kind, {"name": name}, kind)
    return {name: bind(fmt, tokenizer, build_parser=build) for name, fmt in formats.items()}


def _generated(b, history, message):
    """The text the policy generates for ``message`` after ``history``: the template's rendering of it after the
    generation prompt, up to and including the first stop token."""
    conversation = Conversation(b, history, TOOLS)
    before = conversation.render(history, generation_prompt=True)
    after = conversation.render(history + [message], generation_prompt=False)
    assert after.startswith(before)
    text = after[len(before):]
    ends = [text.find(t) + len(t) for t in b.format.all_stop_tokens if t in text]
    return text[:min(ends)] if ends else text


def _strip_stop(b, text):
    for token in b.format.all_stop_tokens:
        if text.endswith(token):
            return text[:-len(token)]
    return text


def _parse(b, text):
    """(reasoning, calls, content) of a generated turn, as a rollout parses it."""
    text, reasoning = _strip_stop(b, text), None
    if b.reasoning_parser is not None:
        split = b.reasoning_parser.split(text)
        reasoning, text = split.reasoning, split.content
    return reasoning, b.tool_parser.parse(text), b.tool_parser.content(text)


# -- the scenario matrix ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_scenario_matrix_is_token_exact(bound, name):
    results = check_format(bound[name])
    assert [r.scenario for r in results if not r.ok] == [], [(r.scenario, r.detail, r.parse_problems) for r in results]
    assert all(not r.parse_problems for r in results)


# -- calls and reasoning parse back -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_rendered_calls_parse_back_to_the_same_calls(bound, name):
    b = bound[name]
    fmt = b.format
    calls = [ToolCall("get_weather", dict(RICH), id=fmt.call_id(0, "get_weather", "t")),
             ToolCall("get_time", {"tz": "Europe/Paris"}, id=fmt.call_id(1, "get_time", "t"))]
    turns = [calls[:1], calls[1:]] if fmt.one_call_per_turn else [calls]
    history, parsed = list(HEAD), []
    for turn in turns:
        message = {"role": "assistant", "content": "", "tool_calls": [fmt.message_call(c) for c in turn]}
        text = _generated(b, history, message)
        _, got, content = _parse(b, text)
        assert content == ""
        parsed += got
        history += [message] + [{"role": "tool", "tool_call_id": c.id, "name": c.name, "content": "ok"} for c in turn]
    assert [(c.name, c.arguments, c.error) for c in parsed] == [(c.name, c.arguments, None) for c in calls]
    if name == "mistral_v3":  # the model writes the ids itself
        assert [c.id for c in parsed] == [c.id for c in calls]
    else:
        assert all(c.id == "" for c in parsed)


@pytest.mark.parametrize("name", ["glm45", "gpt_oss"])
def test_reasoning_is_parsed_into_its_field(bound, name):
    b = bound[name]
    field = b.format.reasoning_field
    message = {"role": "assistant", "content": "It is sunny.", field: "The user wants the weather.\nI know it."}
    reasoning, calls, content = _parse(b, _generated(b, HEAD, message))
    assert (reasoning, calls, content) == ("The user wants the weather.\nI know it.", [], "It is sunny.")
    call = b.format.message_call(ToolCall("get_weather", {"city": "Paris"}))
    message = {"role": "assistant", "content": "", field: "Look it up.", "tool_calls": [call]}
    reasoning, calls, content = _parse(b, _generated(b, HEAD, message))
    assert reasoning == "Look it up." and content == ""
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_glm_reasoning_field_and_empty_think_pair(bound):
    b = bound["glm45"]
    text = _generated(b, HEAD, {"role": "assistant", "content": "Sunny."})
    assert text == "\n<think></think>\nSunny."  # no reasoning: an empty pair, parsed as empty reasoning
    assert _parse(b, text) == ("", [], "Sunny.")


# -- malformed calls --------------------------------------------------------------------------------------------


def _errors(parser, text):
    return [(c.name, c.error) for c in parser.parse(text)]


def test_llama_malformed_calls_name_the_problem():
    parser = llama.Llama3JsonParser()
    calls = parser.parse('{"name": "get_weather", "parameters": {"city": "Paris"}\n'
                         '{"name": "get_time", "parameters": {"tz": "UTC"}}')
    assert "not valid JSON" in calls[0].error and '"parameters"' in calls[0].error
    assert (calls[1].name, calls[1].arguments, calls[1].error) == ("get_time", {"tz": "UTC"}, None)
    assert "must be a JSON object" in parser.parse('{"name": "get_time", "parameters": [1, 2]}')[0].error
    assert 'string "name"' in parser.parse('{"type": "function", "parameters": {}}')[0].error
    assert "not valid JSON" in parser.parse('<|python_tag|>{"name": "get_time", "parameters": {"tz": }}')[0].error


def test_llama_parser_reads_python_tag_semicolons_and_content():
    parser = llama.Llama3JsonParser()
    text = ('Let me check.\n<|python_tag|>{"name": "a", "parameters": {"x": 1}}; '
            '{"name": "b", "arguments": "{\\"y\\": 2}"}')
    assert ([(c.name, c.arguments, c.error) for c in parser.parse(text)]
            == [("a", {"x": 1}, None), ("b", {"y": 2}, None)])
    assert parser.content(text) == "Let me check."
    assert parser.parse("It is sunny in Paris.") == [] and parser.content(" It is sunny. ") == "It is sunny."


def test_mistral_malformed_calls_name_the_problem():
    parser = mistral.MistralToolParser()
    [bad] = parser.parse('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": }, "id": "abcDEF123"}]')
    assert bad.error.startswith("the tool calls after [TOOL_CALLS] are not valid JSON")
    assert 'string "name"' in parser.parse('[TOOL_CALLS] [{"arguments": {}}]')[0].error
    assert "must be a JSON object" in parser.parse('[TOOL_CALLS] [{"name": "f", "arguments": 3}]')[0].error
    assert "not valid JSON" in parser.parse('[TOOL_CALLS] [{"name": "f", "arguments": "{oops"}]')[0].error


def test_glm_malformed_calls_name_the_problem():
    parser = glm.Glm45ToolParser()
    assert _errors(parser, "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>") == [
        ("get_weather", "the tool call to get_weather is not closed with </tool_call>")]
    [(_, error)] = _errors(parser, "<tool_call>get_weather\n<arg_key>city</arg_key>\n</tool_call>")
    assert error == "argument 'city' of get_weather has no <arg_value>...</arg_value> after its </arg_key>"
    [(_, error)] = _errors(parser, "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris\n</tool_call>")
    assert error == "the value of argument 'city' of get_weather is not closed with </arg_value>"
    [(_, error)] = _errors(parser, "<tool_call>get_weather\n<arg_key>city\n<arg_value>Paris</arg_value>\n</tool_call>")
    assert "not closed with </arg_key>" in error
    [(_, error)] = _errors(parser, "<tool_call>get_weather\n<arg_value>Paris</arg_value>\n</tool_call>")
    assert "expected <arg_key>NAME</arg_key>" in error
    [(_, error)] = _errors(parser, "<tool_call>\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>")
    assert "no function name" in error
    text = "Checking.\n<tool_call>get_time\n</tool_call>"
    assert [(c.name, c.arguments, c.error) for c in parser.parse(text)] == [("get_time", {}, None)]
    assert parser.content(text) == "Checking."


def test_gpt_oss_malformed_calls_name_the_problem():
    parser = gpt_oss.HarmonyToolParser()
    [bad] = parser.parse('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": ')
    assert (bad.name, bad.error.split(" (")[0]) == ("get_weather", "the arguments of get_weather are not valid JSON")
    [bad] = parser.parse("<|channel|>commentary to=functions.get_weather <|constrain|>json")
    assert bad.error == "the call to functions.get_weather has no <|message|> with its arguments"
    [bad] = parser.parse('<|channel|>commentary to=functions.get_weather<|message|>["Paris"]')
    assert "must be a JSON object, got list" in bad.error


def test_gpt_oss_reads_the_recipient_in_the_role_header_too():
    parser = gpt_oss.HarmonyToolParser()
    text = ('<|channel|>commentary<|message|>Checking two things.<|end|>'
            '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"tz": "UTC"}')
    assert [(c.name, c.arguments, c.error) for c in parser.parse(text)] == [("get_time", {"tz": "UTC"}, None)]
    assert parser.content(text) == "Checking two things."
    assert parser.content("plain text, no harmony") == "plain text, no harmony"


# -- format specifics -------------------------------------------------------------------------------------------


def test_mistral_call_ids_are_nine_alphanumerics_and_kept(bound):
    b = bound["mistral_v3"]
    ids = [b.format.call_id(i, "get_weather", seed) for seed in ("a", "b") for i in range(20)]
    assert all(is_alnum9(i) for i in ids) and len(set(ids)) == len(ids)
    call = b.format.message_call(ToolCall("get_weather", {"city": "Paris"}, id=ids[0]))
    messages = [*HEAD, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": ids[0], "content": "sunny"}]
    text = Conversation(b, HEAD, TOOLS).render(messages, generation_prompt=True)
    assert f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {{"city": "Paris"}}, "id": "{ids[0]}"}}]</s>' in text
    assert text.endswith(f'[TOOL_RESULTS] {{"content": "sunny", "call_id": "{ids[0]}"}}[/TOOL_RESULTS]')
    parsed = b.tool_parser.parse(f'[TOOL_CALLS] [{{"name": "f", "arguments": {{}}, "id": "{ids[1]}"}}]')
    assert [c.id for c in parsed] == [ids[1]]


def test_glm_boundary_after_a_next_role_token_does_not_repeat_it(bound):
    b = bound["glm45"]
    tokenizer = b.tokenizer
    observation, user = (tokenizer.convert_tokens_to_ids(t) for t in ("<|observation|>", "<|user|>"))
    conversation = Conversation(b, HEAD, TOOLS)
    ids = list(conversation.prompt_ids)
    call = {"role": "assistant", "content": "", "reasoning_content": "Look it up.",
            "tool_calls": [b.format.message_call(ToolCall("get_weather", {"city": "Paris"}))]}
    # the model ends a turn by generating the next role token: <|observation|> after calls, <|user|> after an answer
    turn = conversation.encode(_generated(b, list(conversation.messages), call) + "<|observation|>")
    ids += turn
    conversation.add_policy_turn(call, turn)
    suffix = conversation.extend([{"role": "tool", "content": "sunny"}])
    assert observation not in suffix
    assert (tokenizer.decode(suffix, skip_special_tokens=False)
            == "\n<tool_response>\nsunny\n</tool_response><|assistant|>")
    ids += suffix
    answer = {"role": "assistant", "content": "It is sunny.", "reasoning_content": "Done."}
    turn = conversation.encode(_generated(b, list(conversation.messages), answer) + "<|user|>")
    ids += turn
    conversation.add_policy_turn(answer, turn)
    suffix = conversation.extend([{"role": "user", "content": "And in Rome?"}])
    assert user not in suffix
    ids += suffix
    whole = conversation.encode(conversation.render(conversation.messages, generation_prompt=True))
    assert ids == whole
    assert ids.count(observation) == 1 and ids.count(user) == 2


def test_glm_turn_ended_by_eos_is_a_mismatch_named_with_both_tokens(bound):
    """GLM's template renders an answer followed by the next role token, never by <|endoftext|>: a turn the model ended
    with EOS differs from what a deployed model is given, and says so."""
    b = bound["glm45"]
    conversation = Conversation(b, HEAD, TOOLS)
    answer = {"role": "assistant", "content": "It is sunny."}
    turn = conversation.encode(_generated(b, HEAD, answer).removesuffix("<|user|>") + "<|endoftext|>")
    conversation.add_policy_turn(answer, turn)
    with pytest.raises(NotAppendOnly, match=r"message 2 \(assistant, as the policy generated it\) at token \d+: "
                                            r"'<\|endoftext\|>' became '<\|user\|>'"):
        conversation.extend([{"role": "user", "content": "And in Rome?"}])


def test_llama_renders_tool_results_as_ipython_and_parallel_calls_one_per_line(bound):
    b = bound["llama3"]
    assert b.tokenizer.convert_tokens_to_ids("<|eom_id|>") in b.stop_ids
    calls = [b.format.message_call(ToolCall("get_weather", {"city": "Paris"})),
             b.format.message_call(ToolCall("get_time", {"tz": "Europe/Paris"}))]
    message = {"role": "assistant", "content": "", "tool_calls": calls}
    assert _generated(b, HEAD, message) == ('{"name": "get_weather", "parameters": {"city": "Paris"}}\n'
                                            '{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}<|eot_id|>')
    text = Conversation(b, HEAD, TOOLS).render([*HEAD, message, {"role": "tool", "content": "sunny"},
                                                {"role": "ipython", "content": {"time": "12:00"}}], True)
    assert text.endswith('<|start_header_id|>ipython<|end_header_id|>\n\nsunny<|eot_id|>'
                         '<|start_header_id|>ipython<|end_header_id|>\n\n{"time": "12:00"}<|eot_id|>'
                         '<|start_header_id|>assistant<|end_header_id|>\n\n')
    assert "Environment: ipython\n" in text and "Given the following functions" in text


def test_llama_turn_ended_by_eom_is_a_mismatch_and_one_ended_by_eot_is_exact(bound):
    """The template closes a call turn with <|eot_id|>; a turn the model ended with <|eom_id|> (ipython mode) holds
    another token than a deployed model is given there, and is reported; ended by <|eot_id|>, the result's tokens
    follow it."""
    b = bound["llama3"]
    call = {"role": "assistant", "content": "",
            "tool_calls": [b.format.message_call(ToolCall("get_weather", {"city": "Paris"}))]}
    text = _generated(b, HEAD, call)
    assert text.endswith("<|eot_id|>")
    conversation = Conversation(b, HEAD, TOOLS)
    conversation.add_policy_turn(call, conversation.encode(text.removesuffix("<|eot_id|>") + "<|eom_id|>"))
    with pytest.raises(NotAppendOnly, match="'<\\|eom_id\\|>' became '<\\|eot_id\\|>'"):
        conversation.extend([{"role": "tool", "content": "sunny"}])
    conversation = Conversation(b, HEAD, TOOLS)
    conversation.add_policy_turn(call, conversation.encode(text))
    suffix = conversation.extend([{"role": "tool", "content": "sunny"}])
    assert b.tokenizer.decode(suffix, skip_special_tokens=False) == (
        "<|start_header_id|>ipython<|end_header_id|>\n\nsunny<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


def test_gpt_oss_stops_at_call_and_return_not_at_end(bound):
    b = bound["gpt_oss"]
    ids = lambda *tokens: {b.tokenizer.convert_tokens_to_ids(t) for t in tokens}
    assert ids("<|call|>", "<|return|>") <= set(b.stop_ids) and not ids("<|end|>") & set(b.stop_ids)
    calls = [b.format.message_call(ToolCall(n, {"x": i})) for i, n in enumerate(("a", "b"))]
    text = Conversation(b, HEAD, TOOLS).render([*HEAD, {"role": "assistant", "content": "", "tool_calls": calls},
                                                {"role": "tool", "tool_call_id": "", "name": "a", "content": "1"}],
                                               generation_prompt=True)
    assert text.count("<|call|>") == 2 and "<|start|>functions.a to=assistant" in text
    rendered = text[text.index("<|start|>assistant"):]
    assert [(c.name, c.arguments) for c in b.tool_parser.parse(rendered)] == [("a", {"x": 0}), ("b", {"x": 1})]


def test_gpt_oss_tool_result_names_its_call_by_id(bound):
    b = bound["gpt_oss"]
    calls = [{"id": "c0", "type": "function", "function": {"name": "a", "arguments": "{}"}},
             {"id": "c1", "type": "function", "function": {"name": "b", "arguments": "{}"}}]
    text = Conversation(b, HEAD, TOOLS).render([*HEAD, {"role": "assistant", "content": "", "tool_calls": calls},
                                                {"role": "tool", "tool_call_id": "c0", "content": "1"},
                                                {"role": "tool", "tool_call_id": "c1", "content": "2"}], True)
    assert "<|start|>functions.a to=assistant<|channel|>commentary<|message|>1<|end|>" in text
    assert "<|start|>functions.b to=assistant<|channel|>commentary<|message|>2<|end|>" in text


# -- detection --------------------------------------------------------------------------------------------------


class _Vocabulary:
    """A tokenizer as detection sees it: a family's special tokens and its own chat template."""

    unk_token, unk_token_id = "<unk>", 0

    def __init__(self, tokens, chat_template=""):
        self.ids = {t: i + 1 for i, t in enumerate(tokens)}
        self.chat_template = chat_template

    def convert_tokens_to_ids(self, token):
        return self.ids.get(token, 0)


# each family's special tokens (a few, as its tokenizer lists them) and a fragment of its own chat template
FAMILIES = {
    "llama3": (("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                "<|eom_id|>", "<|python_tag|>", "<|finetune_right_pad_id|>"), "Environment: ipython"),
    "mistral_v3": (("<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                    "[TOOL_RESULTS]", "[/TOOL_RESULTS]"), '"[AVAILABLE_TOOLS] [" ... \'[TOOL_RESULTS] {"content": \''),
    "glm45": (("<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
               "<|assistant|>", "<|observation|>", "<think>", "</think>", "<tool_call>", "</tool_call>"),
              "<arg_key>{{ k }}</arg_key>"),
    "gpt_oss": (("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
                 "<|end|>", "<|message|>", "<|call|>"), "<|channel|>analysis<|message|>"),
}


@pytest.mark.parametrize("name", NAMES)
def test_detection_singles_out_each_family(registry, name):
    formats = {n: registry.get("chat_format", n).obj for n in registry.names("chat_format")}
    tokens, template = FAMILIES[name]
    fmt, candidates = detect(formats, _Vocabulary(tokens, template))
    assert fmt is not None and fmt.name == name, candidates
