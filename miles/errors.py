"""Exceptions that carry a user-facing message and an exit code.

The CLI prints ``str(error)`` without a traceback and exits with ``error.exit_code``.
"""

from __future__ import annotations

import errno

__all__ = ["disk_cause", "disk_problem", "MilesError", "ConfigError", "PluginError", "DataError", "RunError",
           "EngineRequestError", "EXIT_USAGE"]

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


_DISK_FULL = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "the disk quota is used up"}
_NOT_WRITABLE = {errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
                 errno.EPERM: "the operation is not permitted"}


def disk_cause(exc: BaseException | None) -> str | None:
    """Why the disk refused a write, when ``exc`` (or an error it was raised from) says so; else None."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in _DISK_FULL | _NOT_WRITABLE:
            return (_DISK_FULL | _NOT_WRITABLE)[exc.errno]
        exc = exc.__cause__ or exc.__context__
    return None


def disk_problem(exc: BaseException) -> str | None:
    """One line for a write the disk refused (full, quota, read-only, permission), naming the path and what to
    do; None for any other error (a bug, whose traceback is wanted)."""
    if not isinstance(exc, OSError) or (cause := disk_cause(exc)) is None:
        return None
    path = f" ({exc.filename})" if exc.filename else ""
    if exc.errno in _DISK_FULL:
        return (f"{cause} writing{path}: free space there (or move run.dir), then continue with run.resume=true; "
                f"the checkpoints written before are intact")
    return f"{cause} writing{path}: make it writable, or choose another run.dir"
