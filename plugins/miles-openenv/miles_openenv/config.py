"""The ``openenv`` env's arguments, checked at start (``check_args``, a ValueError naming the argument) and
parsed once per trajectory into :class:`Settings`.

Importing this module does not import OpenEnv (its import takes seconds); the checks of an in-process
``env`` import it, as they import the environment class.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import miles

__all__ = ["Settings", "action_class_of", "action_fields", "check", "check_action_schema", "environment_class",
           "import_object", "parse"]

ACTIONS = ("tool", "text", "mcp")
REWARD_FROM = ("auto", "observation", "rubric")
REWARD_MODES = ("last", "sum")
URL_SCHEMES = ("http://", "https://", "ws://", "wss://")


@dataclass(frozen=True)
class Settings:
    """The arguments of one ``openenv`` env node, parsed; see :class:`miles_openenv.env.OpenEnvEnv`."""

    env: str | None = None
    base_url: str | None = None
    env_args: dict[str, Any] = field(default_factory=dict)
    action: str = "tool"
    action_class: str | None = None
    action_field: str | None = None
    tool_name: str | None = None
    observation_field: str | None = None
    reward_from: str = "auto"
    reward_mode: str = "last"
    reset_args: dict[str, Any] = field(default_factory=dict)
    reset_fields: dict[str, str] = field(default_factory=dict)  # reset() argument -> data row field
    system_prompt: str | None = None
    include_prompt: bool = False
    connect_timeout_s: float = 10.0
    message_timeout_s: float = 60.0

    @property
    def where(self) -> str:
        """What the messages name: the environment class, or the server."""
        return f"openenv env {self.env}" if self.env else f"openenv server {self.base_url}"


def parse(args: dict[str, Any]) -> Settings:
    """The settings of ``args`` (the node's arguments over the defaults); a ValueError names a bad one.
    Nothing is imported or contacted here: :func:`check` does the checks that import."""
    args = {k: v for k, v in args.items() if v is not None}
    env, base_url = args.get("env"), args.get("base_url")
    if (env is None) == (base_url is None):
        raise ValueError("env, base_url: set exactly one: env: 'package.module:MyEnvironment' (run in process) "
                         f"or base_url: 'http://host:port' (an OpenEnv server); got env={env!r}, base_url={base_url!r}")
    if env is not None and (not isinstance(env, str) or ":" not in env):
        raise ValueError(f"env: expected an import path 'package.module:MyEnvironment', got {env!r}")
    if base_url is not None and (not isinstance(base_url, str) or not base_url.startswith(URL_SCHEMES)):
        raise ValueError(f"base_url: expected the server's URL, starting with one of {', '.join(URL_SCHEMES)}; "
                         f"got {base_url!r}")
    env_args = _mapping(args, "env_args")
    if env_args and env is None:
        raise ValueError("env_args: only for an environment run in process (env); a server makes its own")
    action = _choice(args, "action", ACTIONS, "tool")
    if args.get("tool_name") is not None and action != "tool":
        raise ValueError("tool_name: only with action: tool")
    if args.get("action_field") is not None and action != "text":
        raise ValueError("action_field: only with action: text")
    if args.get("action_class") is not None and action == "mcp":
        raise ValueError("action_class: not with action: mcp (its actions are OpenEnv's ListToolsAction and "
                         "CallToolAction)")
    reward_from = _choice(args, "reward_from", REWARD_FROM, "auto")
    if reward_from == "rubric" and env is None:
        raise ValueError("reward_from: 'rubric' needs the environment in process (env): a server's rubric is "
                         "applied by the server, into the observation's reward")
    for key in ("action_class", "action_field", "tool_name", "observation_field", "system_prompt"):
        if key in args and not (isinstance(args[key], str) and args[key]):
            raise ValueError(f"{key}: expected a non-empty string, got {args[key]!r}")
    for key in ("connect_timeout_s", "message_timeout_s"):
        value = args.get(key, 1.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{key}: expected a positive number of seconds, got {value!r}")
    if not isinstance(args.get("include_prompt", False), bool):
        raise ValueError(f"include_prompt: expected true or false, got {args['include_prompt']!r}")
    return Settings(
        env=env, base_url=base_url.rstrip("/") if base_url else None, env_args=env_args, action=action,
        action_class=args.get("action_class"), action_field=args.get("action_field"), tool_name=args.get("tool_name"),
        observation_field=args.get("observation_field"), reward_from=reward_from,
        reward_mode=_choice(args, "reward_mode", REWARD_MODES, "last"), reset_args=_mapping(args, "reset_args"),
        reset_fields=_reset_fields(args.get("reset_fields")), system_prompt=args.get("system_prompt"),
        include_prompt=args.get("include_prompt", False), connect_timeout_s=float(args.get("connect_timeout_s", 10.0)),
        message_timeout_s=float(args.get("message_timeout_s", 60.0)),
    )


def check(args: dict[str, Any]) -> Settings:
    """:func:`parse`, plus what can be known before any episode: the classes import, the environment takes
    ``env_args`` and ``reset_args``, its Action class is known and suits ``action`` (``action_field``), and an
    environment for ``action: mcp`` is an MCP one. A server is not contacted."""
    settings = parse(args)
    action_cls = import_object(settings.action_class, "action_class") if settings.action_class else None
    if settings.env is not None:
        env_cls = environment_class(settings.env)
        try:
            inspect.signature(env_cls).bind(**settings.env_args)
        except TypeError as exc:
            raise ValueError(f"env_args: {settings.env} cannot be made with {settings.env_args!r}: {exc}") from exc
        unknown = reset_arguments_refused(env_cls, set(settings.reset_args) | set(settings.reset_fields))
        if unknown:
            raise ValueError(f"reset_args, reset_fields: {settings.env}.reset() takes no argument "
                             f"{', '.join(map(repr, unknown))}")
        if settings.action == "mcp":
            _check_mcp(env_cls, settings.env)
            return settings
        action_cls = action_cls or action_class_of(env_cls)
    if action_cls is not None:
        check_action_schema(action_cls.model_json_schema(), settings, action_cls.__name__)
    return settings


def import_object(path: str, key: str) -> Any:
    """The object at ``package.module:attr``; a ValueError naming ``key`` when it does not import."""
    if not isinstance(path, str) or ":" not in path:
        raise ValueError(f"{key}: expected an import path 'package.module:Name', got {path!r}")
    try:
        obj = miles.import_object(path)
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from exc.__cause__
    if key == "action_class":
        from openenv.core.env_server.types import Action

        if not (inspect.isclass(obj) and issubclass(obj, Action)):
            raise ValueError(f"action_class: {path!r} is not an OpenEnv Action class (a subclass of "
                             f"openenv.core.env_server.types.Action)")
    return obj


def environment_class(path: str) -> type:
    """The OpenEnv ``Environment`` subclass at ``path``."""
    from openenv.core.env_server.interfaces import Environment

    cls = import_object(path, "env")
    if not (inspect.isclass(cls) and issubclass(cls, Environment)):
        raise ValueError(f"env: {path!r} is not an OpenEnv Environment class (a subclass of "
                         f"openenv.core.env_server.interfaces.Environment), got {cls!r}")
    if inspect.isabstract(cls):
        raise ValueError(f"env: {path!r} is abstract: it does not implement "
                         f"{', '.join(sorted(cls.__abstractmethods__))}")
    return cls


def action_class_of(env_cls: type) -> type:
    """The Action class ``env_cls.step`` takes: its annotation, else the ``Environment[Action, ...]`` base."""
    from openenv.core.env_server.types import Action

    def usable(candidate: Any) -> bool:
        return inspect.isclass(candidate) and issubclass(candidate, Action) and candidate is not Action

    try:
        params = list(inspect.signature(env_cls.step).parameters)
        hint = typing.get_type_hints(env_cls.step).get(params[1]) if len(params) > 1 else None
    except Exception:  # an annotation that does not resolve: try the generic base instead
        hint = None
    if usable(hint):
        return hint
    for klass in env_cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if args and usable(args[0]):
                return args[0]
    raise ValueError(f"action_class: cannot tell which Action class {env_cls.__name__}.step() takes (no annotation "
                     f"naming an Action subclass); annotate step(self, action: MyAction) or set action_class")


def reset_arguments_refused(env_cls: type, names: set[str]) -> list[str]:
    """Which of ``names`` the environment's reset() does not take (it takes them all with ``**kwargs``)."""
    params = inspect.signature(env_cls.reset).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return []
    return sorted(names - {p.name for p in params})


def action_fields(schema: dict[str, Any]) -> list[str]:
    """The fields of an Action's JSON schema that the model fills (all but the base class's ``metadata``)."""
    return [name for name in schema.get("properties", {}) if name != "metadata"]


def check_action_schema(schema: dict[str, Any], settings: Settings, name: str) -> None:
    """That the Action's schema suits the mapping: a text field to fill (``action: text``), or any fields at all."""
    fields = action_fields(schema)
    if settings.action == "text":
        if settings.action_field is not None and settings.action_field not in fields:
            raise ValueError(f"action_field: {name} has no field {settings.action_field!r}; its fields: "
                             f"{', '.join(fields) or 'none'}")
        if settings.action_field is None and len(fields) != 1:
            raise ValueError(f"action_field: {name} has {len(fields)} fields ({', '.join(fields) or 'none'}); "
                             f"name the one the turn's text goes to")
    elif not fields:
        raise ValueError(f"action_class: {name} has no fields for the model to fill; set action_class to the Action "
                         f"the environment takes (for an MCP environment: action: mcp)")


def _check_mcp(env_cls: type, path: str) -> None:
    from openenv.core.env_server.mcp_environment import MCPEnvironment

    if not issubclass(env_cls, MCPEnvironment):
        raise ValueError(f"action: 'mcp' needs an MCP environment (a subclass of "
                         f"openenv.core.env_server.mcp_environment.MCPEnvironment); {path} is not one")


def _choice(args: dict[str, Any], key: str, choices: tuple[str, ...], default: str) -> str:
    value = args.get(key, default)
    if value not in choices:
        raise ValueError(f"{key}: expected one of {', '.join(choices)}, got {value!r}")
    return value


def _mapping(args: dict[str, Any], key: str) -> dict[str, Any]:
    value = args.get(key) or {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"{key}: expected a mapping of argument names to values, got {value!r}")
    return dict(value)


def _reset_fields(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return {v: v for v in value}
    if isinstance(value, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        return dict(value)
    raise ValueError(f"reset_fields: expected a list of data fields, or a mapping of reset() argument names to data "
                     f"fields, got {value!r}")
