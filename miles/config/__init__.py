"""Structured config: defaults, loading with overrides, and validation before anything runs."""

from miles.config.load import load_config, parse_overrides
from miles.config.schema import MilesConfig
from miles.config.validate import validate_config

__all__ = ["MilesConfig", "load_config", "parse_overrides", "validate_config"]
