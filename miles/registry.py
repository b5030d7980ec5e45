"""Named components per kind, with provenance.

The registry is filled by calling every plugin's registration hooks with a ``register`` callable
bound to that plugin, so each name records the plugin and distribution version that gave it.
A config node ``{name: ..., **args}`` is turned into a component by :meth:`Registry.build`; anywhere a
name is accepted, an import path ``package.module:attr`` is accepted too (a module of the working directory, or a
``.py`` file: :func:`import_object`). An argument that is itself a component node (declared in the component's
``miles_components``) is checked and built the same way.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import importlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.errors import ConfigError, PluginError
from miles.plugins import PluginInfo, PluginManager

__all__ = ["KINDS", "Kind", "Entry", "Registry", "nested_nodes", "plugin_stack", "import_object"]


@dataclass(frozen=True)
class Kind:
    """A kind of component.

    ``call_params`` is the number of leading arguments a *function* component receives when it is
    used (a reward gets the sample); its config arguments bind to the parameters after those. Kinds
    with ``call_params=None`` are factories: the registered callable is called with the config
    arguments alone and returns the component.
    """

    name: str  # singular, as used in messages: "reward"
    hook: str
    call_params: int | None
    per_use: bool = False  # built into a factory (the callable with its config arguments bound), called once per use
    value: bool = False  # components are registered as ready values (a ChatFormat), not callables

    @property
    def plural(self) -> str:
        return self.name + ("es" if self.name.endswith("x") else "s")


KINDS: dict[str, Kind] = {
    kind.name: kind
    for kind in (
        Kind("reward", "miles_register_rewards", 1),
        Kind("advantage", "miles_register_advantages", 1),
        Kind("loss", "miles_register_losses", 1),
        Kind("data_selector", "miles_register_data_selectors", 1),
        Kind("rollout_fn", "miles_register_rollout_fns", 2),
        Kind("data_generator", "miles_register_data_generators", 1),
        Kind("rollout_engine", "miles_register_rollout_engines", None),
        Kind("env", "miles_register_envs", 1, per_use=True),
        Kind("sandbox", "miles_register_sandboxes", 0, per_use=True),
        Kind("tool", "miles_register_tools", None),
        Kind("tool_parser", "miles_register_tool_parsers", None),
        Kind("reasoning_parser", "miles_register_reasoning_parsers", None),
        Kind("chat_format", "miles_register_chat_formats", None, value=True),
        Kind("backend", "miles_register_backends", None),
        Kind("weight_transport", "miles_register_weight_transports", None),
        Kind("logprob_kernel", "miles_register_logprob_kernels", None),
        Kind("precision", "miles_register_precisions", None),
        Kind("logger", "miles_register_loggers", None),
    )
}

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")


def nested_nodes(obj: Any, args: Mapping[str, Any]) -> list[tuple[str, str, Any]]:
    """The arguments of component ``obj`` that are component nodes themselves, as ``(argument, kind, node)``.

    ``obj.miles_components`` maps such arguments to their kind (``{"reward": "reward"}``); the node is
    the one in ``args``, else the signature's default (a name or a mapping); an argument that is None
    is left out.
    """
    declared = getattr(obj, "miles_components", None) or {}
    if not declared:
        return []
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        params = {}
    nested = []
    for arg, kind in declared.items():
        if arg in args:
            node = args[arg]
        elif arg in params and params[arg].default is not inspect.Parameter.empty:
            node = params[arg].default
        else:
            continue
        if node is not None:
            nested.append((arg, kind, node))
    return nested


def _as_node(node: Any) -> dict[str, Any] | None:
    """A nested component node as a dict (a bare name is ``{name: name}``); None when it is neither."""
    if isinstance(node, str):
        return {"name": node}
    return dict(node) if isinstance(node, Mapping) else None


def _lazy(obj: Any) -> bool:
    """A component registered by its import path (``"package.module:attr"``), imported when first used."""
    return isinstance(obj, str) and ":" in obj


class Entry:
    """A registered component. One registered by its import path is imported when :attr:`obj` is first read, so
    that listing plugins (``miles plugins``) imports none of their heavy dependencies."""

    def __init__(self, kind: str, name: str, obj: Any, plugin: PluginInfo) -> None:
        self.kind, self.name, self.plugin = kind, name, plugin
        self._obj = obj

    def __repr__(self) -> str:
        return f"Entry({self.kind!r}, {self.name!r}, {self._obj!r}, plugin={self.plugin.name!r})"

    @property
    def builtin(self) -> bool:
        return self.plugin.builtin

    @property
    def obj(self) -> Any:
        if _lazy(self._obj):
            try:
                obj = import_object(self._obj)
            except ValueError as exc:
                cause = exc.__cause__ or exc
                raise PluginError(f"plugin {self.plugin.name!r} registered {self.kind} {self.name!r} as "
                                  f"{self._obj!r}, which does not import: {type(cause).__name__}: {cause}") from cause
            if not callable(obj) and not KINDS[self.kind].value:
                raise PluginError(f"plugin {self.plugin.name!r} registered {self.kind} {self.name!r} as "
                                  f"{self._obj!r}, a {type(obj).__name__}; expected a function or a class")
            self._obj = obj
        return self._obj


_IMPORT_PATH = PluginInfo("import path", "", "", "", builtin=False)


class Registry:
    def __init__(self) -> None:
        self._entries: dict[str, dict[str, Entry]] = {kind: {} for kind in KINDS}

    @classmethod
    def from_plugin_manager(cls, pm: PluginManager) -> "Registry":
        registry = cls()
        for kind in KINDS.values():
            impls = getattr(pm.hook, kind.hook).get_hookimpls()
            # Builtins first, so that an explicit override from a plugin comes after what it replaces.
            for impl in sorted(impls, key=lambda impl: not pm.info[impl.plugin_name].builtin):
                info = pm.info[impl.plugin_name]
                register = functools.partial(registry.add, kind.name, plugin=info)
                kwargs = {"register": register}
                impl.function(**{arg: kwargs[arg] for arg in impl.argnames})
        return registry

    def add(self, kind: str, name: str, obj: Any, *, plugin: PluginInfo = _IMPORT_PATH, override: bool = False) -> None:
        if not isinstance(name, str) or not _NAME.match(name):
            raise PluginError(
                f"plugin {plugin.name!r} registered a {kind} named {name!r}; names are letters, digits, "
                f"'_', '.' and '-', starting with a letter or '_'"
            )
        if not callable(obj) and not KINDS[kind].value and not _lazy(obj):
            raise PluginError(
                f"plugin {plugin.name!r} registered {kind} {name!r} as a {type(obj).__name__}; "
                f"expected a function, a class or an import path 'package.module:attr'"
            )
        existing = self._entries[kind].get(name)
        if existing is not None:
            if not (existing.builtin and override):
                hint = (
                    "; to replace the builtin, register it with override=True"
                    if existing.builtin
                    else "; uninstall one of them or leave one out with run.plugins.allow"
                )
                raise PluginError(
                    f"{kind} {name!r} is registered twice: by plugin {existing.plugin.name!r} "
                    f"({existing.plugin.distribution} {existing.plugin.version}) and by plugin "
                    f"{plugin.name!r} ({plugin.distribution} {plugin.version}){hint}"
                )
        self._entries[kind][name] = Entry(kind, name, obj, plugin)

    def names(self, kind: str) -> list[str]:
        return sorted(self._entries[kind])

    def entries(self, kind: str) -> list[Entry]:
        return [self._entries[kind][name] for name in self.names(kind)]

    def get(self, kind: str, name: str, *, where: str | None = None) -> Entry:
        """The entry for ``name`` (or an import path), else a ConfigError listing what exists."""
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where or kind}: expected the name of a {kind}, got {name!r}")
        if ":" in name:
            return Entry(kind, name, _import_path(name, kind, where), _IMPORT_PATH)
        entry = self._entries[kind].get(name)
        if entry is None:
            known = self.names(kind)
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"unknown {kind} {name!r}{f' (at {where})' if where else ''}. Registered "
                f"{KINDS[kind].plural}: {', '.join(known) or 'none'}{hint} An import path "
                f"'package.module:attr' is accepted too."
            )
        return entry

    # -- building components from config nodes ------------------------------------------------------

    def check(self, kind: str, node: Mapping[str, Any], where: str) -> list[str]:
        """Every problem with a component node, as messages (empty when it is fine)."""
        args = dict(node)
        name = args.pop("name", None)
        if name is None:
            return [f"{where}: missing 'name' (the {kind} to use); registered: {', '.join(self.names(kind))}"]
        try:
            entry = self.get(kind, name, where=f"{where}.name")
        except ConfigError as exc:
            return [str(exc)]
        problems = [f"{where}.{problem}" for problem in _check_args(entry, KINDS[kind], args)]
        for arg, nested_kind, nested in nested_nodes(entry.obj, args):
            nested_node = _as_node(nested)
            if nested_node is None:
                problems.append(f"{where}.{arg}: expected a {nested_kind} node ({{name: ..., args}}) or the name of "
                                f"a {nested_kind}, got {nested!r}")
            else:
                problems += self.check(nested_kind, nested_node, f"{where}.{arg}")
        return problems

    def build(self, kind: str, node: Mapping[str, Any], where: str) -> Any:
        """The component for a node ``{name, **args}``, after checking its arguments."""
        problems = self.check(kind, node, where)
        if problems:
            raise ConfigError("\n".join(problems))
        args = {key: value for key, value in node.items() if key != "name"}
        obj = self.get(kind, node["name"]).obj
        for arg, nested_kind, nested in nested_nodes(obj, args):  # built first: the component gets them built
            args[arg] = self.build(nested_kind, _as_node(nested), f"{where}.{arg}")
        call_params = KINDS[kind].call_params
        try:
            if KINDS[kind].per_use:
                factory = functools.partial(obj, **args)
                inspect.signature(factory)  # a TypeError here names an argument the callable cannot take
                return factory
            if inspect.isclass(obj) or call_params is None:
                return obj(**args)
            if not args:
                return obj
            bound = functools.partial(obj, **args)
            functools.update_wrapper(bound, obj)
            return bound
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where}: {kind} {node['name']!r} rejected its arguments: {exc}") from exc


def import_object(path: str) -> Any:
    """The object at the import path ``package.module:name`` (``name`` may be dotted: ``module:Class.method``), or
    ``file.py:name``. A module is looked for among the installed packages, then in the working directory
    (``my_reward:score`` finds ``./my_reward.py``, as ``python -m`` would); a ``.py`` file's path (relative to the
    working directory, or absolute) loads that file. A ValueError when ``path`` is not of that form, or does not
    import (the import's error is its cause)."""
    module_name, sep, attr = path.rpartition(":") if isinstance(path, str) else ("", "", "")
    if not module_name or not sep or not attr:
        raise ValueError(f"expected an import path 'package.module:name' (or 'path/to/file.py:name'), got {path!r}")
    try:
        obj: Any = _load_file(Path(module_name)) if module_name.endswith(".py") else _import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as exc:
        raise ValueError(f"cannot import {path!r}: {type(exc).__name__}: {exc}") from exc
    return obj


def _import_module(name: str) -> Any:
    """Module ``name``, installed or in the working directory."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        top, here = name.split(".")[0], Path.cwd()
        if exc.name != top:  # the module was found; something it imports was not
            raise
        if not ((here / f"{top}.py").is_file() or (here / top / "__init__.py").is_file()):
            raise ModuleNotFoundError(f"no module named {top!r} among the installed packages nor in the working "
                                      f"directory {here} (a file's path works too: path/to/file.py:name)",
                                      name=top) from None
        sys.path.append(str(here))  # after the installed packages: they keep their names
        importlib.invalidate_caches()
        return importlib.import_module(name)


def _load_file(path: Path) -> Any:
    """The module of the Python file ``path``, loaded once per process."""
    path = path.resolve()
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (a relative path is taken from the working directory)")
    name = f"miles_file_{hashlib.blake2b(str(path).encode(), digest_size=6).hexdigest()}_{path.stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[name] = module  # before it runs: a dataclass or pickle in it looks its module up by name
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _import_path(path: str, kind: str, where: str | None) -> Any:
    try:
        obj = import_object(path)
    except ValueError as exc:
        cause = exc.__cause__ or exc
        raise ConfigError(f"{where or kind}: cannot import {kind} {path!r}: {type(cause).__name__}: {cause}") from cause
    if not callable(obj) and not KINDS[kind].value:
        raise ConfigError(f"{where or kind}: {path!r} is a {type(obj).__name__}, expected a function or class")
    return obj


_TYPES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _type_problem(value: Any, annotation: Any) -> str | None:
    if isinstance(annotation, str):  # postponed annotations: only the simple ones are checked
        annotation = {"int": int, "float": float, "bool": bool, "str": str}.get(annotation)
    if annotation not in _TYPES or value is None:
        return None
    ok = isinstance(value, annotation) and not (annotation is int and isinstance(value, bool))
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    return None if ok else f"expects {_TYPES[annotation]}, got {value!r}"


def _check_args(entry: Entry, kind: Kind, args: dict[str, Any]) -> list[str]:
    obj = entry.obj
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return []  # builtins and C callables cannot be inspected; they fail at call time instead
    params = list(signature.parameters.values())
    if kind.call_params and (kind.per_use or not inspect.isclass(obj)):
        params = params[kind.call_params :]
    accepts_any = any(p.kind is p.VAR_KEYWORD for p in params)
    named = {p.name: p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    problems = []
    for key, value in args.items():
        if key in named:
            problem = _type_problem(value, named[key].annotation)
            if problem:
                problems.append(f"{key}: {kind.name} {entry.name!r} {problem}")
        elif not accepts_any:
            close = difflib.get_close_matches(key, named, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            problems.append(
                f"{key}: {kind.name} {entry.name!r} takes no argument {key!r}; it accepts: "
                f"{', '.join(named) or 'no arguments'}{hint}"
            )
    for name, param in named.items():
        if param.default is param.empty and name not in args:
            problems.append(f"{name}: {kind.name} {entry.name!r} requires argument {name!r}")
    return problems


def plugin_stack(pm: PluginManager, registry: Registry) -> list[dict[str, Any]]:
    """Every plugin with its version and what it registered, by kind (``run.json``'s ``plugins``)."""
    stack = []
    for name, info in pm.info.items():
        registered: dict[str, list[str]] = {}
        for kind in KINDS:
            names = [e.name for e in registry.entries(kind) if e.plugin.name == name]
            if names:
                registered[kind] = names
        stack.append(
            {"name": name, "version": info.version, "distribution": info.distribution,
             "module": info.module, "builtin": info.builtin, "registered": registered}
        )
    return stack
