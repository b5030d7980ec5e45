"""Exceptions that carry a user-facing message and an exit code.

The CLI prints ``str(error)`` without a traceback and exits with ``error.exit_code``.
"""

from __future__ import annotations

__all__ = ["MilesError", "ConfigError", "PluginError", "DataError", "RunError", "EngineRequestError", "EXIT_USAGE"]

EXIT_USAGE = 2


class MilesError(Exception):
    """Base class for errors whose message is meant for the user."""

    exit_code = 1


class ConfigError(MilesError):
    """The configuration (file, override or component arguments) is wrong."""

    exit_code = EXIT_USAGE


class PluginError(MilesError):
    """A plugin failed to import, or registered something it should not have."""

    exit_code = EXIT_USAGE


class DataError(MilesError):
    """An input data file is missing or its rows do not have the expected shape."""

    exit_code = EXIT_USAGE


class RunError(MilesError):
    """The run started but cannot go on (e.g. too many failed samples)."""

    exit_code = 1


class EngineRequestError(ValueError):
    """An engine refused a request (HTTP 400): the request is wrong, retrying will not help. Raised by the
    router to rollout functions and to weight transports alike."""
