"""Builtin chat formats, their tool parsers and reasoning parsers (one module per family in
:mod:`miles.agentic.formats`)."""

from miles import hookimpl
from miles.agentic import formats
from miles.agentic.chat_format import ThinkTagReasoning


@hookimpl(trylast=True)
def miles_register_chat_formats(register):
    for fmt in formats.formats():
        register(fmt.name, fmt)


@hookimpl(trylast=True)
def miles_register_reasoning_parsers(register):
    register("think", ThinkTagReasoning)
    for name, factory in formats.parsers("reasoning_parser").items():
        register(name, factory)


@hookimpl(trylast=True)
def miles_register_tool_parsers(register):
    for name, factory in formats.parsers("tool_parser").items():
        register(name, factory)
