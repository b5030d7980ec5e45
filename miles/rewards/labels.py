"""What a reward needs of the label it scores against (``label_types``, :class:`miles.hookspecs.NeedsLabel`), and
the checks made with it: over the data before the run starts (:func:`label_need`, then
:func:`miles.rollout.data_source.check_labels`), and on each sample before the reward is called
(:func:`label_problem`).

A missing label must never reach a reward that compares against one: ``exact_match`` once read it as ``""``,
so an empty response scored 1.0 and the policy learned to answer nothing.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from miles.registry import Registry, nested_nodes

__all__ = ["LabelNeed", "declared_label_types", "describe_types", "is_empty_label", "label_need", "label_problem",
           "require_label", "show_label"]

_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", dict: "an object",
               list: "a list"}


@dataclass(frozen=True)
class LabelNeed:
    """The label a config's reward node needs: ``reward`` names the reward(s) that need it (``format > math``),
    ``types`` the label types every one of them compares; ``who`` says who needs it when that is not a reward."""

    reward: str
    types: tuple[type, ...]
    who: str = ""

    @property
    def subject(self) -> str:
        return self.who or f"reward {self.reward!r}"


def declared_label_types(reward: Any) -> tuple[type, ...] | None:
    """The ``label_types`` a reward (a function, class or instance, a ``functools.partial`` of one) declares;
    None when it declares none (it does not read the label)."""
    while True:
        if hasattr(reward, "label_types"):  # isinstance(reward, NeedsLabel), without a protocol check's cost
            return tuple(reward.label_types)
        if not isinstance(reward, functools.partial):
            return None
        reward = reward.func


def label_need(registry: Registry, node: Mapping[str, Any], where: str = "") -> LabelNeed | None:
    """What the reward ``node`` (``{name, **args}``) needs of labels: its own ``label_types`` and those of the
    rewards nested in it (``format``'s ``reward``), the types all of them accept; None when none reads the label."""
    args = {key: value for key, value in node.items() if key != "name"}
    obj = registry.get("reward", node["name"]).obj
    needs = []
    own = declared_label_types(obj)
    if own is not None:
        needs.append(LabelNeed(f"{where}{node['name']}", own))
    for _, kind, nested in nested_nodes(obj, args):
        inner = {"name": nested} if isinstance(nested, str) else dict(nested) if isinstance(nested, Mapping) else None
        if kind == "reward" and inner is not None:
            found = label_need(registry, inner, f"{where}{node['name']} > ")
            if found is not None:
                needs.append(found)
    if not needs:
        return None
    types = tuple(t for t in needs[0].types if all(t in need.types for need in needs[1:]))
    return LabelNeed(needs[-1].reward, types)


def is_empty_label(label: Any) -> bool:
    """No label to score against: None (a missing key reads as None), a blank string or an empty list."""
    return label is None or (isinstance(label, str) and not label.strip()) or (isinstance(label, list) and not label)


def label_problem(label: Any, types: tuple[type, ...]) -> str | None:
    """Why a reward comparing labels of ``types`` cannot score against ``label`` ("it has none", "it is an object
    ({...})"); None when it can. A bool is not an int here, and a tuple counts as a list."""
    if is_empty_label(label):
        return "it has none" if label is None else f"it is empty ({show_label(label)})"
    if isinstance(label, tuple):
        label = list(label)
    if _accepts(label, types):
        entries = tuple(t for t in types if t is not list)
        if isinstance(label, list) and entries:  # (list,) alone: a list of anything
            for i, entry in enumerate(label):
                if is_empty_label(entry) and not isinstance(entry, list):
                    return f"entry {i + 1} of its list is {'null' if entry is None else 'empty'} ({show_label(entry)})"
                if isinstance(entry, (list, tuple)) or not _accepts(entry, entries):
                    return (f"entry {i + 1} of its list is {_type_name(entry)} ({show_label(entry)}); expected "
                            f"{describe_types(entries)}")
        return None
    return f"it is {_type_name(label)} ({show_label(label)}); expected {describe_types(types)}"


def describe_types(types: tuple[type, ...]) -> str:
    """``(str, int, float, list)`` as "a string, a number or a list of them" (a number: an integer or not)."""
    shown = [t for t in types if t is not list and not (t is int and float in types)]
    names = [_TYPE_NAMES.get(t, f"a {t.__name__}") for t in shown]
    if list in types:
        names.append("a list of them" if names else "a list")
    if not names:
        return "no label at all (its rewards accept no type in common)"
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def show_label(label: Any, limit: int = 60) -> str:
    """A label as the data file wrote it (JSON-like), cut to ``limit`` characters."""
    try:
        text = json.dumps(label, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(label)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _accepts(label: Any, types: tuple[type, ...]) -> bool:
    if isinstance(label, bool):
        return bool in types
    if isinstance(label, int) and float in types:
        return True
    return isinstance(label, tuple(t for t in types if t is not bool))


def _type_name(label: Any) -> str:
    if label is None:
        return "null"
    for kind in (bool, str, int, float, dict, list, tuple):
        if isinstance(label, kind):
            return _TYPE_NAMES.get(kind, "a list")
    return f"a {type(label).__name__}"


def require_label(label: Any, types: tuple[type, ...]) -> Any:
    """``label``, or a ValueError saying why a reward comparing ``types`` cannot score against it: the reward's
    own guard, for samples that reach it without the stage's check (nested in ``format``, called directly)."""
    problem = label_problem(label, types)
    if problem is not None:
        if is_empty_label(label):
            empty = "" if label is None else f", only {show_label(label)}"
            raise ValueError(f"the sample has no label (data.label_key{empty}) to score against")
        raise ValueError(f"the sample's label cannot be scored against: {problem}")
    return label
