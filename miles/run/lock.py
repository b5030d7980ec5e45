"""One run per run directory at a time.

A run holds a POSIX lock on ``<run.dir>/.miles.lock`` from before its first check to its end. The kernel drops
the lock with the process, so a run that was SIGKILLed never leaves its directory locked; a second run on the
same directory is refused at once, naming the holder. The file holds the holder's pid and host (for that
message only); it is removed when its run ends, and a failed start leaves the directory as it found it: the
lock file gone, and the folders it had to create for it removed again.

POSIX (``fcntl``) locks rather than ``flock``: a child forked by the run does not inherit them, so an engine or
a sandbox that outlives a killed run cannot keep its directory locked, and they work on NFS.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from miles.errors import ConfigError

__all__ = ["LOCK_NAME", "RunDirLock"]

LOCK_NAME = ".miles.lock"


class RunDirLock:
    """``with RunDirLock(run_dir) as lock:`` holds ``run_dir`` for this process; :meth:`keep` once the run has
    written into it (a start that fails before that removes the folders it created for the lock)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.path = run_dir / LOCK_NAME
        self._fd: int | None = None
        self._created: list[Path] = []  # folders made for the lock, deepest first
        self._keep = False

    def __enter__(self) -> RunDirLock:
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise ConfigError(f"run.dir {str(self.run_dir)!r} is a file; expected a directory for the run's outputs")
        self._created = _missing_folders(self.run_dir)
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._lock()
        except BaseException as exc:
            self._release()
            self._remove_created()
            if isinstance(exc, OSError):
                raise ConfigError(f"run.dir {str(self.run_dir)!r} cannot hold a run: {exc.strerror} "
                                  f"({exc.filename or self.run_dir}); choose a directory this user can write "
                                  f"to (run.dir=...)") from exc
            raise
        return self

    def keep(self) -> None:
        """The run has written into ``run_dir``: it stays, whatever happens next."""
        self._keep = True

    def __exit__(self, *exc: object) -> None:
        self._release()
        if not self._keep:
            self._remove_created()

    def _lock(self) -> None:
        """Lock the lock file. One that its holder removed between our open and our lock is not the lock any
        more (the holder removes it before it lets go): open the new one."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno not in (errno.EACCES, errno.EAGAIN):
                    raise
                raise ConfigError(f"run.dir {str(self.run_dir)!r} is in use by another run ({_holder(self.path)}); "
                                  f"wait for it to end, or choose another run.dir") from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            self._fd = fd
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                     "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}).encode())
            return

    def _release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        except OSError:
            pass  # a read-only folder now: the lock still goes with the descriptor
        os.close(self._fd)
        self._fd = None

    def _remove_created(self) -> None:
        for folder in self._created:
            try:
                folder.rmdir()
            except OSError:
                return  # not empty: another run's now


def _missing_folders(path: Path) -> list[Path]:
    """``path`` and its ancestors that do not exist, deepest first."""
    missing = []
    for folder in (path, *path.absolute().parents):
        if folder.exists():
            break
        missing.append(folder)
    return missing


def _holder(path: Path) -> str:
    try:
        holder = json.loads(path.read_text())
        return f"pid {holder['pid']} on {holder['host']}, since {holder['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its pid is not written yet"
