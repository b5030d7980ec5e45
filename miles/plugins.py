"""Building the plugin manager: builtins, entry points, allow lists.

A fresh manager is built for every run; nothing is registered at import time.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType

import pluggy

from miles import hookspecs
from miles.errors import PluginError

__all__ = ["DEFAULT_PLUGINS", "ENTRY_POINT_GROUP", "PluginInfo", "PluginManager", "build_plugin_manager"]

ENTRY_POINT_GROUP = "miles"
AUTOLOAD_ENV = "MILES_DISABLE_PLUGIN_AUTOLOAD"

DEFAULT_PLUGINS: tuple[str, ...] = (
    "miles.builtin.rewards",
    "miles.builtin.advantages",
    "miles.builtin.losses",
    "miles.builtin.selectors",
    "miles.builtin.rollout",
    "miles.builtin.chat_formats",
    "miles.builtin.sandboxes",
    "miles.builtin.tools",
    "miles.builtin.dots",
    "miles.builtin.engines",
    "miles.builtin.backends",
    "miles.builtin.kernels",
    "miles.builtin.weight_transports",
    "miles.builtin.precision",
    "miles.builtin.loggers",
    "miles.builtin.data",
)


@dataclass(frozen=True)
class PluginInfo:
    name: str
    module: str
    distribution: str
    version: str
    builtin: bool


class PluginManager(pluggy.PluginManager):
    """pluggy's manager plus where each plugin came from."""

    def __init__(self) -> None:
        super().__init__("miles")
        self.add_hookspecs(hookspecs)
        self.info: dict[str, PluginInfo] = {}

    def register_plugin(self, plugin: object, info: PluginInfo) -> None:
        if info.name in self.info:
            raise PluginError(
                f"two plugins are named {info.name!r}: {self.info[info.name].module} "
                f"({self.info[info.name].distribution}) and {info.module} ({info.distribution})"
            )
        try:
            self.register(plugin, name=info.name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"plugin {info.name!r} ({info.module}) has a bad hook: {exc}") from exc
        self.info[info.name] = info


def _miles_version() -> str:
    from miles._version import __version__

    return __version__


def _import(module_path: str, what: str) -> ModuleType:
    try:
        return importlib.import_module(module_path)
    except Exception as exc:  # re-raised with the plugin named
        raise PluginError(
            f"Error importing plugin {what}: {type(exc).__name__}: {exc}. Fix or uninstall that "
            f"package, or leave it out with {AUTOLOAD_ENV}=1 or an allow list (run.plugins.allow)."
        ) from exc


def autoload_disabled() -> bool:
    return os.environ.get(AUTOLOAD_ENV, "").strip().lower() in ("1", "true", "yes")


def build_plugin_manager(
    allow: Sequence[str] | None = None,
    *,
    autoload: bool | None = None,
    extra_plugins: Iterable[tuple[str, object]] = (),
) -> PluginManager:
    """Build a fresh plugin manager.

    Builtins are loaded first through the same path as entry points. Entry points of group
    ``miles`` follow unless autoload is off (``MILES_DISABLE_PLUGIN_AUTOLOAD=1``); ``allow``
    restricts them to the named plugins. ``extra_plugins`` are ``(name, object)`` pairs registered
    last (tests and embedding code use them).
    """
    pm = PluginManager()
    version = _miles_version()
    for module_path in DEFAULT_PLUGINS:
        pm.register_plugin(
            _import(module_path, repr(module_path)),
            PluginInfo(module_path, module_path, "miles", version, builtin=True),
        )

    if autoload is None:
        autoload = not autoload_disabled()
    if autoload:
        entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        known = {ep.name for ep in entry_points}
        if allow is not None:
            missing = sorted(set(allow) - known)
            if missing:
                raise PluginError(
                    f"run.plugins.allow names plugins that are not installed: {', '.join(missing)}; "
                    f"installed plugins (entry-point group {ENTRY_POINT_GROUP!r}): "
                    f"{', '.join(sorted(known)) or 'none'}"
                )
        for ep in sorted(entry_points, key=lambda ep: ep.name):
            if allow is not None and ep.name not in allow:
                continue
            dist = ep.dist.name if ep.dist else "unknown"
            dist_version = ep.dist.version if ep.dist else "unknown"
            where = f"{ep.name!r} (entry point {ep.name} = {ep.value} of {dist} {dist_version})"
            try:
                plugin = ep.load()
            except Exception as exc:
                raise PluginError(
                    f"Error importing plugin {where}: {type(exc).__name__}: {exc}. Fix or uninstall "
                    f"that package, or leave it out with {AUTOLOAD_ENV}=1 or an allow list "
                    f"(run.plugins.allow)."
                ) from exc
            module = getattr(plugin, "__name__", ep.value)
            pm.register_plugin(plugin, PluginInfo(ep.name, module, dist, dist_version, builtin=False))

    for name, plugin in extra_plugins:
        module = getattr(plugin, "__name__", type(plugin).__module__)
        pm.register_plugin(plugin, PluginInfo(name, module, "local", "0", builtin=False))

    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"a plugin implements a hook that Miles does not define: {exc}") from exc
    return pm
