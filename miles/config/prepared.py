"""A run's definition, checked: the config with its plugin manager and registry, every component validated."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from miles.config.algorithms import apply_estimator_defaults
from miles.config.load import load_config
from miles.config.validate import split_node, validate_config
from miles.interrupts import with_time_limit
from miles.plugins import PluginManager, build_plugin_manager
from miles.registry import Registry

__all__ = ["Prepared", "prepare"]


class Prepared:
    def __init__(self, config: DictConfig, pm: PluginManager, registry: Registry) -> None:
        self.config, self.pm, self.registry = config, pm, registry

    def build(self, kind: str, key: str) -> Any:
        """The component the config names at ``key`` (a dotted path), built from the registry's ``kind``."""
        args, extra = split_node(OmegaConf.select(self.config, key), key)
        component = self.registry.build(kind, args, key)
        # the stage that calls it keeps to the limit (rollout.fn, reward); cluster.local_mode sets none, so that a
        # plain reward runs on the main thread (not a watchdog's) and a breakpoint does not time the sample out
        if "timeout_s" in extra and not self.config.cluster.local_mode:
            component = with_time_limit(component, extra["timeout_s"])
            component.miles_name = args["name"]  # what failure reasons call it: the config's name
        return component


def prepare(config_path: str | Path | None, overrides: Sequence[str] = (), extra_plugins=()) -> Prepared:
    """Load the config, build the plugin manager and registry, validate every component."""
    config = load_config(config_path, overrides)
    pm = build_plugin_manager(config.run.plugins.allow, extra_plugins=extra_plugins)
    registry = Registry.from_plugin_manager(pm)
    apply_estimator_defaults(config, registry)
    validate_config(config, registry)
    pm.hook.miles_configure(config=config)
    validate_config(config, registry)
    return Prepared(config, pm, registry)
