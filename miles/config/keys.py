"""A config key declared next to its field: its default, a one-line meaning and the values it accepts.

:func:`key` returns a dataclass field whose metadata holds them; validation (:mod:`miles.config.validate`)
and the reference table of docs/config.md (:mod:`miles.config.reference`) both read them through :func:`keys`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Accepts", "Key", "key", "keys", "like"]


def _word(value: Any) -> str:
    """A choice as YAML writes it: true, null, auto."""
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else str(value)


@dataclass(frozen=True)
class Accepts:
    """What a key accepts: a range (``ge``, ``gt``, ``le``) and/or ``choices``, plus ``also`` values outside them
    (-1 for off). ``note`` is added to the derived wording in brackets; ``expected`` replaces it."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    choices: tuple[Any, ...] | None = None
    also: tuple[Any, ...] = ()
    note: str | None = None
    expected: str | None = None

    def __call__(self, value: Any) -> bool:
        if value in self.also:
            return True
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.choices is None or value in self.choices))

    def describe(self, whole: bool) -> str:
        """What is expected, in words: ``a whole number >= 1``, ``k1, k2 or k3``."""
        if self.expected is not None:
            return self.expected
        if self.choices is not None:
            words = list(dict.fromkeys(_word(c) for c in self.choices))
            text = f"{', '.join(words[:-1])} or {words[-1]}" if len(words) > 1 else words[0]
        else:
            number = "a whole number" if whole else "a number"
            if self.gt is not None and self.le is not None:
                text = f"{number} in ({self.gt}, {self.le}]"
            elif self.ge is not None and self.le is not None:
                text = f"{number} in [{self.ge}, {self.le}]"
            elif self.gt == 0:
                text = f"a positive {number.removeprefix('a ')}"
            elif self.gt is not None:
                text = f"{number} > {self.gt}"
            else:
                text = f"{number} >= {self.ge}"
        return f"{text} ({self.note})" if self.note else text


def key(default: Any = dataclasses.MISSING, *, doc: str, factory: Any = dataclasses.MISSING, **accepts: Any) -> Any:
    """A dataclass field with its meaning (``doc``, one line) and, given :class:`Accepts`' arguments, the values it
    accepts."""
    metadata = {"doc": doc, "accepts": Accepts(**accepts) if accepts else None}
    return dataclasses.field(default=default, default_factory=factory, metadata=metadata)


def like(section: type, name: str) -> dict[str, Any]:
    """The :class:`Accepts` arguments of ``section``'s key ``name``, for a key that accepts the same."""
    accepts = next(f for f in dataclasses.fields(section) if f.name == name).metadata["accepts"]
    return {f.name: getattr(accepts, f.name) for f in dataclasses.fields(accepts)}


@dataclass(frozen=True)
class Key:
    """One key of the schema: ``path`` is dotted (``eval.datasets[i].n`` for a section of a list), ``type`` the
    annotation without its ``Optional``, ``default`` the default value (a section's for a section)."""

    path: str
    type: Any
    optional: bool
    doc: str
    accepts: Accepts | None
    default: Any

    @property
    def expected(self) -> str:
        return self.accepts.describe(whole=self.type is int) if self.accepts else ""

    def problem(self, value: Any, where: str | None = None) -> str | None:
        """What is wrong with ``value`` for this key (named ``where``), or None when it is accepted."""
        if self.accepts is None or (value is None and self.optional) or self.accepts(value):
            return None
        return f"{where or self.path}: expected {self.expected}, got {value!r}"


def _unwrap(annotation: Any) -> tuple[Any, bool]:
    """(the annotation without ``Optional``, whether it was optional)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in typing.get_args(annotation):
        rest = [a for a in typing.get_args(annotation) if a is not type(None)]
        return (rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]), True
    return annotation, False


def _key(path: str, annotation: Any, field: dataclasses.Field) -> Key:
    base, optional = _unwrap(annotation)
    if field.default is not dataclasses.MISSING:
        default = field.default
    else:
        default = field.default_factory() if field.default_factory is not dataclasses.MISSING else dataclasses.MISSING
    return Key(path, base, optional, field.metadata.get("doc", ""), field.metadata.get("accepts"), default)


def keys(section: type, prefix: str = "", extra: Mapping[str, dataclasses.Field] | None = None) -> Iterator[Key]:
    """Every key of ``section`` and of the sections below it, in declaration order; the elements of a list of
    sections as ``path[i].key``. ``extra``: sections added by hand at a dotted path (a key that is a Python
    keyword, ``rollout.async``), each after the keys of the section that holds it."""
    hints = typing.get_type_hints(section)
    for field in dataclasses.fields(section):
        yield from _walk(prefix + field.name, hints[field.name], field, extra or {})
    for path, field in (extra or {}).items():
        if path.rpartition(".")[0] == prefix.removesuffix("."):
            yield from _walk(path, field.default_factory, field, extra or {})


def _walk(path: str, annotation: Any, field: dataclasses.Field,
          extra: Mapping[str, dataclasses.Field]) -> Iterator[Key]:
    entry = _key(path, annotation, field)
    yield entry
    if dataclasses.is_dataclass(entry.type):
        yield from keys(entry.type, f"{path}.", extra)
    elif typing.get_origin(entry.type) is list and dataclasses.is_dataclass(typing.get_args(entry.type)[0]):
        yield from keys(typing.get_args(entry.type)[0], f"{path}[i].", extra)
