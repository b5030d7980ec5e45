"""Finding tool calls in generated text and checking them against JSON schemas."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from miles.agentic.tool_calls import (MAX_DEPTH, HermesParser, PythonBlockParser, RefusedJSON, check_calls,
                                      decode_json, loads_json)
from miles.agentic.tool_env import execute_python_code
from miles.testing import make_registry

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
TOOLS = [ADD, execute_python_code.schema]


def test_hermes_finds_several_calls_and_the_text_around_them():
    text = ('Sure.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
            '<tool_call>{"name": "execute_python_code", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>')
    parser = HermesParser()
    checked = check_calls(parser.parse(text), TOOLS)
    assert [(c.name, c.arguments, c.error) for c in checked.calls] == [
        ("add", {"a": 1, "b": 2}, None), ("execute_python_code", {"code": "print(1)"}, None)]
    assert [c.id for c in checked.calls] == ["", ""]  # the text carries no ids: the rollout gives the format's
    assert parser.content(text) == "Sure."
    assert (checked.parse_errors, checked.schema_errors) == (0, 0)


@pytest.mark.parametrize("body, kind, message", [
    ('{"name": "add", "arguments": {"a": 1, "b": 2}', "parse", "not valid JSON"),
    ('["add"]', "parse", 'a JSON object with a string "name"'),
    ('{"name": "add", "arguments": 3}', "parse", "the arguments of add must be a JSON object, got int"),
    ('{"name": "mul", "arguments": {}}', "schema", "unknown tool 'mul'; available: add, execute_python_code"),
    ('{"name": "add", "arguments": {"a": "1", "b": 2}}', "schema",
     "1 validation error for add: a: '1' is not of type 'integer'"),
    ('{"name": "execute_python_code", "arguments": {"source": "print(1)"}}', "schema",
     "2 validation errors for execute_python_code: arguments: 'code' is a required property; "
     "arguments: Additional properties are not allowed ('source' was unexpected)"),
])
def test_bad_calls_carry_the_reason_and_are_counted(body, kind, message):
    checked = check_calls(HermesParser().parse(f"<tool_call>{body}</tool_call>"), TOOLS)
    (call,) = checked.calls
    assert message in call.error
    assert (checked.parse_errors, checked.schema_errors) == ((1, 0) if kind == "parse" else (0, 1))
    assert checked.valid == []


def test_an_unclosed_call_is_a_parse_error():
    checked = check_calls(HermesParser().parse('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}'), TOOLS)
    assert "not closed" in checked.calls[0].error and checked.parse_errors == 1


def test_python_block_is_a_call_of_the_python_tool():
    text = "I will compute it.\n```python\nprint(12*34)\n```\nand\n```py\nprint(2)\n```"
    parser = PythonBlockParser()
    calls = check_calls(parser.parse(text), TOOLS).valid
    assert [(c.name, c.arguments) for c in calls] == [("execute_python_code", {"code": "print(12*34)\n"}),
                                                     ("execute_python_code", {"code": "print(2)\n"})]
    assert parser.content(text) == "I will compute it.\n\nand"
    assert parser.parse("```python\nprint(1)")[0].error == "the python block is not closed with ```"
    assert parser.parse("no code here") == []


def test_parsers_and_tools_are_registered():
    registry = make_registry()
    assert {"hermes", "python_block"} <= set(registry.names("tool_parser"))
    assert "execute_python_code" in registry.names("tool")
    assert "tool_env" in registry.names("env")
    parser = registry.build("tool_parser", {"name": "python_block", "tool": "run", "argument": "src"},
                            "rollout.tool_parser")
    assert parser.parse("```python\nx\n```")[0].arguments == {"src": "x\n"}


# Where each builtin parser reads a call's arguments: ARGS is the arguments object as JSON text (GLM: the value of
# argument "x", which GLM writes as its own tag). python_block reads no JSON: its block is the code, whatever it holds.
FORMS = {
    "hermes": lambda args: f'<tool_call>{{"name": "add", "arguments": {args}}}</tool_call>',
    "llama3_json": lambda args: f'{{"name": "add", "parameters": {args}}}',
    "mistral": lambda args: f'[TOOL_CALLS] [{{"name": "add", "arguments": {args}, "id": "abcDEF123"}}]',
    "harmony": lambda args: f"<|channel|>commentary to=functions.add <|constrain|>json<|message|>{args}<|call|>",
    "deepseek_v3": lambda args: ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n"
                                 f"{args}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    "deepseek_v31": lambda args: ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>"
                                  f"{args}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    "kimi_k2": lambda args: ("<|tool_calls_section_begin|><|tool_call_begin|>functions.add:0"
                             f"<|tool_call_argument_begin|>{args}<|tool_call_end|><|tool_calls_section_end|>"),
    "glm45": lambda args: _glm(args.removeprefix('{"x": ').removesuffix("}")),
}


def _glm(value):
    return f"<tool_call>add\n<arg_key>x</arg_key>\n<arg_value>{value}</arg_value>\n</tool_call>"

DEEP = "[" * 100_000 + "]" * 100_000
# (the value of argument "x", what the call's error says)
HOSTILE = {
    "100k-deep array": (DEEP, "nested too deeply (objects and arrays more than 64 levels"),
    "100k-deep object": ('{"a": ' * 100_000 + "1" + "}" * 100_000, "nested too deeply"),
    "65 levels": ("[" * 65 + "]" * 65, "nested too deeply"),
    "5000-digit integer": ("7" * 5000, "an integer has 5000 digits, more than the 4300 Python converts"),
    "negative 5000-digit integer": ("-" + "7" * 5000, "an integer has 5000 digits"),
    "lone surrogate": ('"\\ud800"', "holds \\ud800, half of a surrogate pair"),
    "lone surrogate key": ('{"\\udfff": 1}', "holds \\udfff, half of a surrogate pair"),
}


@pytest.fixture(scope="module")
def parsers():
    registry = make_registry()
    return {name: registry.build("tool_parser", {"name": name}, "rollout.tool_parser")
            for name in registry.names("tool_parser")}


def test_every_builtin_tool_parser_is_in_the_hostile_input_matrix(parsers):
    assert set(parsers) == {*FORMS, "python_block"}


@pytest.mark.parametrize("hostile", HOSTILE)
@pytest.mark.parametrize("parser", FORMS)
def test_hostile_arguments_make_a_call_marked_with_an_error_never_an_exception(parsers, parser, hostile):
    value, reason = HOSTILE[hostile]
    text = "Checking.\n" + FORMS[parser](f'{{"x": {value}}}')
    checked = check_calls(parsers[parser].parse(text), TOOLS)
    (call,) = checked.calls
    assert reason in call.error and len(call.error) < 400, call.error
    assert (checked.parse_errors, checked.schema_errors, checked.valid) == (1, 0, [])
    # harmony's content is its final and preamble messages' text: here none (the text before is the call's header)
    assert parsers[parser].content(text) == ("" if parser == "harmony" else "Checking.")


@pytest.mark.parametrize("hostile", HOSTILE)
@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_hostile_arguments_sent_as_a_json_string_are_refused_too(parsers, parser, hostile):
    value, reason = HOSTILE[hostile]
    (call,) = parsers[parser].parse(FORMS[parser](json.dumps(f'{{"x": {value}}}')))
    where = ' (in "parameters")' if parser == "llama3_json" else ""
    assert reason in call.error and f"the arguments of add{where} are not valid JSON" in call.error, call.error


def test_the_depth_limit_is_exact_and_what_it_admits_decodes():
    within = "[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1)
    assert decode_json(f'{{"x": {within}}} and more') == ({"x": json.loads(within)}, len(within) + 7)
    with pytest.raises(RefusedJSON, match="more than 64 levels"):
        loads_json(f'{{"x": [{within}]}}')
    assert loads_json(" \n[1] \t") == [1]
    with pytest.raises(json.JSONDecodeError, match="Extra data"):
        loads_json("[1] [2]")


def test_a_python_block_holding_hostile_text_is_code_as_written(parsers):
    for value, _ in HOSTILE.values():
        (call,) = parsers["python_block"].parse(f"```python\n{value}\n```")
        assert call.error is None and call.arguments == {"code": f"{value}\n"}


_MARKERS = sorted({"<tool_call>", "</tool_call>", "```python\n", "```json\n", "```", "[TOOL_CALLS]", "<|python_tag|>",
                   "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<|start|>", "<|channel|>", "<|message|>",
                   "<|constrain|>", "<|call|>", "<|end|>", " to=functions.add ", "commentary", "<｜tool▁calls▁begin｜>",
                   "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "function",
                   "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                   "<|tool_call_argument_begin|>", "<|tool_call_end|>", "functions.add:0", '{"name": "add", ',
                   '"arguments": ', '"parameters": ', '"id": "abcDEF123"', "}", "]", "\n", ";"})
_JSON = st.recursive(st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                   max_size=3),
                     max_leaves=8).map(json.dumps)
_PIECES = st.one_of(st.sampled_from(_MARKERS), _JSON, st.text(max_size=12),
                    st.integers(1, 3000).map(lambda n: "[" * n + "]" * n), st.integers(4000, 6000).map("9".__mul__),
                    st.sampled_from(['"\\ud800"', '"\\udc00x"', "NaN", "-Infinity", "1e999", '"\\u0000"']))


# a call in one of the parsers' forms, its arguments' value any of the pieces, amid any of them
_CALLS = st.tuples(st.sampled_from(sorted(FORMS)), st.lists(_PIECES, min_size=1, max_size=3)).map(
    lambda form: FORMS[form[0]]('{"x": ' + "".join(form[1]) + "}"))


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(pieces=st.lists(_PIECES | _CALLS, max_size=12))
def test_no_text_makes_a_parser_raise(parsers, pieces):
    """Whatever a model writes, every parser answers with calls (a bad one carrying its error) and content."""
    text = "".join(pieces)
    for name, parser in parsers.items():
        calls = parser.parse(text)
        assert isinstance(parser.content(text), str)
        for call in check_calls(calls, TOOLS).calls:
            assert isinstance(call.name, str) and (call.error is not None or isinstance(call.arguments, dict)), name
