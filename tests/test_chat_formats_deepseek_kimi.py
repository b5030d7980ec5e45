"""The DeepSeek (R1, V3, V3.1) and Kimi-K2 chat formats on real vocabularies: the scenario matrix is token-exact,
rendered calls and reasoning parse back, malformed calls say what is wrong, and detection picks the format from
the published template's markers (and refuses to guess between DeepSeek's formats without one)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from miles.agentic.chat import Conversation
from miles.agentic.chat_check import TOOLS, check_format, scenario_messages
from miles.agentic.chat_format import bind, detect
from miles.testing import make_registry
from miles.models.vocabularies import build_bpe_tokenizer

DEEPSEEK = ("deepseek_r1", "deepseek_v3", "deepseek_v31")
NAMES = (*DEEPSEEK, "kimi_k2")
EOS = "<｜end▁of▁sentence｜>"


@pytest.fixture(scope="module")
def registry():
    return make_registry()


@pytest.fixture(scope="module")
def formats(registry):
    return {name: registry.get("chat_format", name).obj for name in registry.names("chat_format")}


def _kimi_tokens(formats):
    fmt = formats["kimi_k2"]
    return (*fmt.all_stop_tokens, *fmt.identify)


@pytest.fixture(scope="module")
def tokenizers(formats):
    """DeepSeek's real vocabulary, and Qwen's real vocabulary with Kimi's special tokens added (Kimi's own is
    not packaged)."""
    return {"deepseek": build_bpe_tokenizer("deepseek"), "kimi": build_bpe_tokenizer("qwen", _kimi_tokens(formats))}


@pytest.fixture(scope="module")
def bound(registry, formats, tokenizers):
    def make(name, **template_kwargs):
        tokenizer = tokenizers["kimi" if name == "kimi_k2" else "deepseek"]
        return bind(formats[name], tokenizer, template_kwargs=template_kwargs,
                    build_parser=lambda kind, parser: registry.build(kind, {"name": parser}, kind))
    return make


def _turn(fmt, messages, k):
    """The text the policy generates for assistant message ``k`` (its stop token stripped), as the template has it."""
    conversation = Conversation(fmt, messages[:1], TOOLS)
    prompt = conversation.render(messages[:k], generation_prompt=True)
    whole = conversation.render(messages[:k + 1], generation_prompt=False)
    assert whole.startswith(prompt)
    text = whole[len(prompt):]
    end = min(text.index(t) for t in fmt.format.end_of_turn if t in text)
    return text[:end]


def _calls_and_content(fmt, text):
    reasoning = None
    if fmt.reasoning_parser is not None:
        split = fmt.reasoning_parser.split(text)
        reasoning, text = split.reasoning, split.content
    calls = fmt.tool_parser.parse(text)
    return reasoning, [(c.name, c.arguments, c.id, c.error) for c in calls], fmt.tool_parser.content(text)


@pytest.mark.parametrize("name, kwargs", [(n, {}) for n in NAMES] + [("deepseek_v31", {"thinking": False})])
def test_the_scenario_matrix_is_token_exact(bound, name, kwargs):
    results = check_format(bound(name, **kwargs))
    assert [(r.scenario, r.ok) for r in results if not r.ok] == [], [(r.scenario, r.detail, r.parse_problems)
                                                                      for r in results if not r.ok]


@pytest.mark.parametrize("name, ids", [
    ("deepseek_r1", ["", ""]), ("deepseek_v3", ["", ""]), ("deepseek_v31", ["", ""]),
    ("kimi_k2", ["functions.get_weather:0", "functions.get_time:1"]),  # Kimi writes the ids itself
])
def test_rendered_calls_parse_back_to_the_same_calls(bound, name, ids):
    fmt = bound(name)
    messages = scenario_messages(fmt.format, "parallel_calls")
    reasoning, calls, content = _calls_and_content(fmt, _turn(fmt, messages, 2))
    assert calls == [("get_weather", {"city": "Paris"}, ids[0], None),
                     ("get_time", {"tz": "Europe/Paris"}, ids[1], None)]
    assert content == ""
    if name == "kimi_k2":  # the ids the model wrote are the ids the results name
        assert [m["tool_call_id"] for m in messages[3:5]] == ids


def test_content_before_the_calls_is_the_content(bound):
    for name in NAMES:
        fmt = bound(name)
        call = {"id": fmt.format.call_id(0, "get_weather"), "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        messages = [{"role": "user", "content": "Weather?"},
                    {"role": "assistant", "content": "Let me check.", "tool_calls": [call]}]
        _, calls, content = _calls_and_content(fmt, _turn(fmt, messages, 1))
        assert (content, [c[:2] for c in calls]) == ("Let me check.", [("get_weather", {"city": "Paris"})]), name


@pytest.mark.parametrize("name, scenario, k, reasoning, ends", [
    ("deepseek_r1", "reasoning", 2, "I should look this up.", "<｜Assistant｜><think>\n"),
    ("deepseek_r1", "reasoning", 5, "Both answers are in.", "<｜tool▁outputs▁end｜><think>\n"),
    ("deepseek_r1", "one_call", 2, "Let me think.", "<｜Assistant｜><think>\n"),  # every R1 turn reasons
    ("deepseek_v31", "reasoning", 2, "I should look this up.", "<｜Assistant｜><think>"),
    ("deepseek_v31", "reasoning", 5, "Both answers are in.", "<｜tool▁output▁end｜>"),  # the model opens <think> itself
    ("deepseek_v31", "reasoning_off", 5, None, "<｜tool▁output▁end｜>"),
])
def test_reasoning_is_parsed_into_its_field(bound, name, scenario, k, reasoning, ends):
    fmt = bound(name)
    messages = scenario_messages(fmt.format, scenario)
    assert Conversation(fmt, messages[:1], TOOLS).render(messages[:k], generation_prompt=True).endswith(ends)
    got, calls, content = _calls_and_content(fmt, _turn(fmt, messages, k))
    assert got == reasoning == messages[k].get("reasoning_content")
    assert content == messages[k]["content"]


def test_v31_without_thinking_closes_the_reasoning_in_the_generation_prompt(bound):
    fmt = bound("deepseek_v31", thinking=False)
    messages = scenario_messages(fmt.format, "final_answer", reasoning=False)
    conversation = Conversation(fmt, messages[:2], TOOLS)
    assert conversation.render(messages[:2], generation_prompt=True).endswith("<｜User｜>What is the weather in Paris?"
                                                                               "<｜Assistant｜></think>")
    assert _calls_and_content(fmt, _turn(fmt, messages, 2)) == (None, [], "It is sunny in Paris.")


def test_deepseek_v3_turns_are_the_documented_ones(bound):
    fmt = bound("deepseek_v3")
    messages = scenario_messages(fmt.format, "parallel_calls")
    text = Conversation(fmt, messages[:1]).render(messages, generation_prompt=False)
    assert text.endswith(
        "<｜User｜>What is the weather in Paris?<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"
        "<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>\n"
        "<｜tool▁call▁begin｜>function"
        "<｜tool▁sep｜>get_time\n```json\n{\"tz\": \"Europe/Paris\"}\n```<｜tool▁call▁end｜>"
        "<｜tool▁calls▁end｜>" + EOS +
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜>\n<｜tool▁output▁begin｜>12:00"
        "<｜tool▁output▁end｜><｜tool▁outputs▁end｜>Sunny, and it is noon." + EOS)


def test_kimi_results_name_their_call_even_without_a_tool_call_id(bound):
    fmt = bound("kimi_k2")
    messages = scenario_messages(fmt.format, "parallel_calls")
    bare = [*messages[:3], {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "12:00"}]
    text = Conversation(fmt, messages[:1]).render(bare, generation_prompt=True)
    assert text.endswith("<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nsunny<|im_end|>"
                         "<|im_system|>tool<|im_middle|>## Return of functions.get_time:1\n12:00<|im_end|>"
                         "<|im_assistant|>assistant<|im_middle|>")


V3_CALL = ("<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```"
           "<｜tool▁call▁end｜>")
V31_CALL = "<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\"}<｜tool▁call▁end｜>"
KIMI_CALL = ("<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Paris\"}"
             "<|tool_call_end|>")


@pytest.mark.parametrize("parser, text, error", [
    ("deepseek_v3", "<｜tool▁calls▁begin｜>" + V3_CALL,
     "the tool-call section is not closed with <｜tool▁calls▁end｜>"),
    ("deepseek_v3", "<｜tool▁calls▁begin｜>" + V3_CALL[:-len("<｜tool▁call▁end｜>")],
     "the tool call is not closed with <｜tool▁call▁end｜>"),
    ("deepseek_v3", "<｜tool▁calls▁begin｜>" + V3_CALL.replace('"Paris"}', '"Paris"') + "<｜tool▁calls▁end｜>",
     "the arguments of get_weather are not valid JSON"),
    ("deepseek_v3", "<｜tool▁calls▁begin｜>" + V3_CALL.replace("\n```<", "<") + "<｜tool▁calls▁end｜>",
     "the arguments of get_weather are not closed with ```"),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather\n{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     "the tool call has no <｜tool▁sep｜>"),
    ("deepseek_v3", V3_CALL + "<｜tool▁calls▁end｜>", "the tool calls are not opened with <｜tool▁calls▁begin｜>"),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁calls▁end｜>", "the tool-call section holds no call"),
    ("deepseek_v31", "<｜tool▁calls▁begin｜>" + V31_CALL,
     "the tool-call section is not closed with <｜tool▁calls▁end｜>"),
    ("deepseek_v31", "<｜tool▁calls▁begin｜>" + V31_CALL.replace("}", "") + "<｜tool▁calls▁end｜>",
     "the arguments of get_weather are not valid JSON"),
    ("deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>[1]<｜tool▁call▁end｜>"
                     "<｜tool▁calls▁end｜>", "the arguments of get_weather must be a JSON object, got list"),
    ("kimi_k2", "<|tool_calls_section_begin|>" + KIMI_CALL, "the tool-call section is not closed with "
                                                            "<|tool_calls_section_end|>"),
    ("kimi_k2", "<|tool_calls_section_begin|>" + KIMI_CALL.replace("}", "") + "<|tool_calls_section_end|>",
     "the arguments of get_weather are not valid JSON"),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0{\"city\": \"Paris\"}"
                "<|tool_call_end|><|tool_calls_section_end|>", "the tool call has no <|tool_call_argument_begin|>"),
])
def test_malformed_calls_carry_what_is_wrong(registry, parser, text, error):
    (call,) = registry.build("tool_parser", {"name": parser}, "tool_parser").parse("Checking." + text)
    assert call.error is not None and error in call.error


def test_a_call_in_a_good_section_next_to_a_bad_one_keeps_its_own_result(registry):
    parser = registry.build("tool_parser", {"name": "kimi_k2"}, "tool_parser")
    text = ("<|tool_calls_section_begin|>" + KIMI_CALL + KIMI_CALL.replace(":0", ":1").replace("}", "")
            + "<|tool_calls_section_end|>")
    good, bad = parser.parse(text)
    assert (good.name, good.arguments, good.id, good.error) == ("get_weather", {"city": "Paris"},
                                                                "functions.get_weather:0", None)
    assert bad.id == "functions.get_weather:1" and "not valid JSON" in bad.error


def test_text_without_calls_has_none(registry):
    for parser in ("deepseek_v3", "deepseek_v31", "kimi_k2"):
        built = registry.build("tool_parser", {"name": parser}, "tool_parser")
        assert (built.parse("It is sunny."), built.content(" It is sunny.\n")) == ([], "It is sunny.")


# the distinguishing pieces of each family's published chat template (a few characters each)
PUBLISHED_MARKERS = {
    "deepseek_r1": "{% set content = content.split('</think>')[-1] %}"
                   "{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>'}}{{'```json'}}{{'<｜Assistant｜><think>\\n'}}",
    "deepseek_v3": "{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>'}}{{'\\n' + '```json' + '\\n'}}",
    "deepseek_v31": "{{'<｜Assistant｜></think>'}}{%- if not thinking -%}{{'</think>'}}{%- else -%}{{'<think>'}}",
}


@pytest.mark.parametrize("name", DEEPSEEK)
def test_detection_picks_the_deepseek_format_its_published_template_marks(formats, tokenizers, name):
    tokenizer = tokenizers["deepseek"]
    saved, tokenizer.chat_template = tokenizer.chat_template, PUBLISHED_MARKERS[name]
    try:
        found, candidates = detect(formats, tokenizer)
    finally:
        tokenizer.chat_template = saved
    assert found is not None and found.name == name
    assert sorted(candidates) == list(DEEPSEEK)


def test_detection_refuses_to_guess_between_deepseek_formats_without_a_template(formats, tokenizers):
    tokenizer = tokenizers["deepseek"]
    saved, tokenizer.chat_template = tokenizer.chat_template, None
    try:
        found, candidates = detect(formats, tokenizer)
    finally:
        tokenizer.chat_template = saved
    assert found is None and sorted(candidates) == list(DEEPSEEK)


@pytest.mark.parametrize("template", [None, "{{'<|im_system|>tool_declare<|im_middle|>'}}{{'## Return of '}}"])
def test_detection_picks_kimi_from_its_tokens(formats, tokenizers, template):
    tokenizer = tokenizers["kimi"]
    saved, tokenizer.chat_template = tokenizer.chat_template, template
    try:
        found, candidates = detect(formats, tokenizer)
    finally:
        tokenizer.chat_template = saved
    assert found is not None and found.name == "kimi_k2" and "kimi_k2" in candidates
