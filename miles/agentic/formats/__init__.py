"""The builtin chat formats, one module per model family.

Each module lists its formats in ``FORMATS``, its tool parsers in ``TOOL_PARSERS`` and its reasoning
parsers in ``REASONING_PARSERS`` (name -> factory); :mod:`miles.builtin.chat_formats` registers them.
Templates are written from each family's documented format and live in ``miles/templates``.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

FAMILIES = ("qwen", "deepseek", "llama", "mistral", "glm", "gpt_oss", "kimi")


def family_modules() -> list[ModuleType]:
    """The family modules (imported on first use: they import the chat format contract, which uses this)."""
    return [importlib.import_module(f"{__name__}.{family}") for family in FAMILIES]


def formats() -> list[Any]:
    """Every builtin ``ChatFormat``."""
    return [fmt for module in family_modules() for fmt in module.FORMATS]


def parsers(kind: str) -> dict[str, Any]:
    """The families' parser factories of ``kind`` (``tool_parser`` or ``reasoning_parser``) by name."""
    table = "TOOL_PARSERS" if kind == "tool_parser" else "REASONING_PARSERS"
    return {name: factory for module in family_modules() for name, factory in getattr(module, table).items()}
