"""Loading a YAML config, applying ``key=value`` overrides, merging onto the structured defaults.

Every unknown key and wrong type is collected and reported at once.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from miles.config.schema import COMPONENT_NODES, structured_defaults
from miles.errors import ConfigError

__all__ = ["load_config", "parse_overrides"]


def parse_overrides(overrides: Sequence[str], schema: DictConfig | None = None) -> DictConfig:
    """``key=value`` items as one config. A value for a string key is taken literally (a path keeps its `` #``
    and its line breaks; quote it, ``'...'``, only to say null or to strip spaces); any other value is read as
    YAML, and refused where YAML would drop or fold part of it (a comment, a line break)."""
    schema = structured_defaults() if schema is None else schema
    dotlist = []
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. run.steps=50)")
        value = _literal_value(key.strip(), text, _declared_type(schema, key.strip()))
        # A literal goes through OmegaConf's YAML reading as a JSON string, which YAML reads back unchanged.
        dotlist.append(item if value is _AS_YAML else f"{key}={json.dumps(value, ensure_ascii=False)}")
    try:
        return OmegaConf.from_dotlist(dotlist)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot parse overrides {list(overrides)}: {exc}") from exc


def _declared_type(schema: DictConfig, key: str) -> tuple[Any, bool] | None:
    """(type, optional) of a key of the schema, or None for a key in an open mapping, a list or nowhere."""
    node: Any = schema
    for part in key.split("."):
        if not isinstance(node, DictConfig) or "[" in part or part not in node:
            return None
        node = node._get_node(part)
    meta = node._metadata
    return (meta.ref_type, meta.optional) if not isinstance(node, DictConfig | ListConfig) else None


_QUOTED = re.compile(r"""^\s*('.*'|".*")\s*$""", re.DOTALL)
_COMMENT = re.compile(r"(^|\s)#")


_AS_YAML = object()


def _literal_value(key: str, text: str, declared: tuple[Any, bool] | None) -> Any:
    """What an override's text means for a string key (see :func:`parse_overrides`), or ``_AS_YAML`` for any
    other key once its text is known to read as YAML without losing a part."""
    quoted = _QUOTED.match(text) is not None
    if declared is not None and declared[0] is str:
        if quoted:
            return _yaml_value(key, text)
        if declared[1] and text.strip() in ("null", "~"):
            return None
        return text
    _yaml_value(key, text)  # its syntax, named
    if quoted:
        return _AS_YAML
    if "\n" in text or "\r" in text:
        raise ConfigError(f"override {key}={text!r} has a line break, which YAML folds into a space; "
                          f"quote the value ('...') or remove the line break")
    if _ends_in_comment(text):
        comment = _COMMENT.search(text)
        dropped = text[comment.start():].strip() if comment else "its end"
        raise ConfigError(f"override {key}={text!r} has a '#' after a space, which YAML reads as a comment "
                          f"(dropping {dropped!r}); quote the value ('...') or remove it")
    return _AS_YAML


def _ends_in_comment(text: str) -> bool:
    """Whether YAML reads ``text`` as a value and a comment: then a character added at its end changes nothing."""
    try:
        return yaml.safe_load(text) == yaml.safe_load(text + "x")
    except yaml.YAMLError:
        return False


def _yaml_value(key: str, text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"override {key}={text!r} is not a valid YAML value ({problem}); quote it ('...') "
                          f"to pass it as text") from exc


class _UniqueKeyLoader(yaml.SafeLoader):
    """A safe loader that refuses a key repeated in one mapping (YAML would silently keep the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice in one mapping (lines {seen[key]} and {line}); "
                    f"merge the two into one", key_node.start_mark)
            seen[key] = line
        return super().construct_mapping(node, deep)


def _read_yaml(path: Path) -> DictConfig:
    if path.is_dir():
        raise ConfigError(f"config file {str(path)!r} is a directory; expected a YAML file "
                          f"(e.g. configs/quickstart.yaml)")
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text (is it a binary file?)") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}") from exc
    if data is None:
        raise ConfigError(f"config file {str(path)!r} is empty; expected a mapping of sections "
                          f"(model:, data:, rollout:, run: ...), e.g. configs/quickstart.yaml")
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections, got {type(data).__name__}")
    return OmegaConf.create(data)


def _leaves(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) for every leaf; open mappings under `Any` fields are merged whole."""
    if isinstance(node, dict) and node:
        out = []
        for key, value in node.items():
            out.extend(_leaves(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return [(prefix, node)]


def _describe(exc: OmegaConfBaseException, key: str, value: Any, source: str, schema: DictConfig,
              prefix: str = "") -> str:
    """``prefix``: where ``schema`` sits in the whole config, for a section of a list (``eval.datasets[0]``)."""
    shown = f"{prefix}.{key}" if prefix else key
    if isinstance(exc, ConfigKeyError):
        # Walk down to the first part of the key that the schema does not have.
        node: Any = schema
        path: list[str] = [prefix] if prefix else []
        for part in key.split("."):
            if not isinstance(node, DictConfig) or part not in node:
                break
            path.append(part)
            node = node[part]
        known = list(node.keys()) if isinstance(node, DictConfig) else []
        close = difflib.get_close_matches(part, known, n=1)
        hint = f"; did you mean {'.'.join(path + [close[0]])!r}?" if close else ""
        section = ".".join(path) or "the top level"
        return f"unknown config key {shown!r} (in {source}); the keys of {section} are: {', '.join(known)}{hint}"
    if isinstance(exc, ValidationError):
        default = OmegaConf.select(schema, key, throw_on_missing=False)
        expected = type(default).__name__ if default is not None else "the declared type"
        return f"config key {shown!r} (in {source}) expects {expected}, got {value!r} ({type(value).__name__})"
    return f"config key {shown!r} (in {source}): {exc}"


def _list_problems(key: str, value: Any, source: str, schema: DictConfig) -> list[str]:
    """A list of sections (``eval.datasets``): each element checked against its section's schema, the
    problems named by index (``eval.datasets[1].n``)."""
    try:
        node = OmegaConf.select(schema, key, throw_on_missing=False) if key else None
    except OmegaConfBaseException:  # a mapping where the schema has a list (eval.datasets.a): said by the merge
        return []
    element = getattr(getattr(node, "_metadata", None), "element_type", None) if isinstance(node, ListConfig) else None
    if element is None or not dataclasses.is_dataclass(element):
        return []
    if not isinstance(value, list):
        return [f"config key {key!r} (in {source}) expects a list of {element.__name__} sections, got {value!r}"]
    problems = []
    for i, item in enumerate(value):
        where = f"{key}[{i}]"
        if not isinstance(item, dict):
            problems.append(f"config key {where!r} (in {source}) expects a mapping, "
                            f"got {item!r} ({type(item).__name__})")
            continue
        section = OmegaConf.structured(element)
        for leaf, leaf_value in _leaves(item):
            try:
                section.merge_with(_nest(leaf, leaf_value))
            except OmegaConfBaseException as exc:
                problems.append(_describe(exc, leaf, leaf_value, source, OmegaConf.structured(element), where))
    return problems


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> DictConfig:
    """The merged config: structured defaults, then the file, then the overrides."""
    schema = structured_defaults()
    sources: list[tuple[str, DictConfig]] = []
    if path is not None:
        sources.append((str(path), _read_yaml(Path(path))))
    if overrides:
        sources.append(("overrides", parse_overrides(overrides, schema)))

    merged = schema.copy()
    problems: list[str] = []
    given: dict[str, str] = {}  # each key set so far, and where
    for source, cfg in sources:
        container = OmegaConf.to_container(cfg, resolve=False)
        leaves = _leaves(container)
        if source == "overrides":
            for notice in _reset_renamed_components(merged, leaves, given):
                print(notice, file=sys.stderr)
        given.update((key, source) for key, _ in leaves)
        for key, value in leaves:
            if isinstance(value, bool) and (_declared_type(schema, key) or (None,))[0] is str:
                value = "true" if value else "false"  # YAML's spelling, not Python's 'True'
            if element_problems := _list_problems(key, value, source, schema):
                problems.extend(element_problems)
                continue
            try:
                merged.merge_with(_nest(key, value))
            except OmegaConfBaseException as exc:
                problems.append(_describe(exc, key, value, source, schema))
    if problems:
        raise ConfigError("Config is not well-formed, found the following errors:\n- " + "\n- ".join(problems))
    return merged


def _reset_renamed_components(merged: DictConfig, leaves: list[tuple[str, Any]],
                              given: dict[str, str]) -> list[str]:
    """``reward.name=other`` on the command line drops the file's arguments for the old reward (they were the old
    component's); returns a notice for each component that had some, naming them (those the overrides give again
    are not dropped)."""
    notices = []
    overridden = {key for key, _ in leaves}
    for key, value in leaves:
        node, _, leaf = key.rpartition(".")
        if leaf == "name" and node in COMPONENT_NODES:
            current = OmegaConf.select(merged, node)
            if isinstance(current, DictConfig) and current.get("name") != value:
                OmegaConf.update(merged, node, {"name": value}, merge=False)
                dropped = [k for k in given if k.startswith(node + ".") and k != key and k not in overridden]
                if dropped:
                    where = sorted({given[k] for k in dropped})
                    notices.append(f"{key}={value} replaces {current.get('name')!r}: its arguments from "
                                   f"{', '.join(where)} are dropped ({', '.join(dropped)}); give those that apply to "
                                   f"{value!r} again as overrides ({dropped[0]}=...)")
    return notices


def _nest(key: str, value: Any) -> DictConfig:
    node: Any = value
    for part in reversed(key.split(".")):
        node = {part: node}
    return OmegaConf.create(node)
