"""Builtin chat formats, their tool parsers and reasoning parsers (one module per family in
:mod:`miles.agentic.formats`)."""

import importlib

from miles import hookimpl
from miles.agentic.chat_format import ThinkTagReasoning
from miles.agentic.formats import FAMILIES

_MODULES = [importlib.import_module(f"miles.agentic.formats.{family}") for family in FAMILIES]


@hookimpl(trylast=True)
def miles_register_chat_formats(register):
    for module in _MODULES:
        for fmt in module.FORMATS:
            register(fmt.name, fmt)


@hookimpl(trylast=True)
def miles_register_reasoning_parsers(register):
    register("think", ThinkTagReasoning)
    for module in _MODULES:
        for name, factory in module.REASONING_PARSERS.items():
            register(name, factory)


@hookimpl(trylast=True)
def miles_register_tool_parsers(register):
    for module in _MODULES:
        for name, factory in module.TOOL_PARSERS.items():
            register(name, factory)
