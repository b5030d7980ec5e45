"""The reference table of docs/config.md, rendered from the schema: each key's type, default, accepted
values and meaning as declared next to its field (a test checks the file is up to date).

    python -m miles.config.reference
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

from miles.config.keys import Key
from miles.config.schema import COMPONENT_LISTS, COMPONENT_NODES, OPTIONAL_NODES, schema_keys

__all__ = ["BEGIN", "END", "render", "update"]

BEGIN = "<!-- BEGIN config reference: generated from miles/config/schema.py by `python -m miles.config.reference` -->"
END = "<!-- END config reference -->"
DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def _type(entry: Key) -> str:
    """The type in words: ``int``, ``list[str]``, ``section``, ``reward node``."""
    tp, origin, args = entry.type, typing.get_origin(entry.type), typing.get_args(entry.type)
    if entry.path in COMPONENT_LISTS:
        text = f"list of {COMPONENT_LISTS[entry.path]} nodes"
    elif entry.path in COMPONENT_NODES:
        text = f"{COMPONENT_NODES[entry.path]} node"
    elif dataclasses.is_dataclass(tp):
        return "section"
    elif origin is list and dataclasses.is_dataclass(args[0]):
        text = "list of sections"
    elif origin in (list, dict):
        text = origin.__name__ + (f"[{', '.join(a.__name__ for a in args)}]" if Any not in args else "")
    else:
        text = "any" if tp is Any else tp.__name__
    return f"{text} or null" if entry.optional or entry.path in OPTIONAL_NODES else text


def _value(value: Any) -> str:
    """A default as YAML writes it in flow style; a node that is only a name as the name."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, str):
        return value if value and value == value.strip() else repr(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    return repr(value)


def _default(entry: Key) -> str:
    value = entry.default
    if dataclasses.is_dataclass(value) or value is dataclasses.MISSING:
        return ""
    if entry.path in COMPONENT_NODES and isinstance(value, dict) and list(value) == ["name"]:
        value = value["name"]
    return f"`{_value(value)}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    """The table, one row per key (sections included) in the schema's order."""
    rows = ["| key | type | default | accepts | meaning |", "| --- | --- | --- | --- | --- |"]
    for entry in schema_keys():
        accepts = entry.expected
        rows.append(f"| `{entry.path}` | {_type(entry)} | {_cell(_default(entry))} | {_cell(accepts)} | "
                    f"{_cell(entry.doc)} |")
    return "\n".join(rows)


def update(text: str) -> str:
    """``text`` (docs/config.md) with the table between its markers rendered afresh."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return f"{text[:start]}\n{render()}\n{text[end:]}"


if __name__ == "__main__":
    DOC.write_text(update(DOC.read_text()))
    print(f"wrote {DOC}")
