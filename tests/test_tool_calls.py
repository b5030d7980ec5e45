"""Finding tool calls in generated text and checking them against JSON schemas."""

import pytest

from miles.agentic.tool_calls import HermesParser, PythonBlockParser, check_calls
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
