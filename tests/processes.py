"""Helpers of the tests that watch child processes (an engine's server, a trainer): whether one runs, waiting
for it to end, and this process's children by command line."""

import os
import time
from pathlib import Path


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: it has exited and waits to be reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pid: int, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def children(marker: str, parent: int | None = None) -> list[int]:
    """Running children of ``parent`` (this process by default) whose command line (arguments joined by NUL)
    contains ``marker``."""
    parent = os.getpid() if parent is None else parent
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            ppid = int(next(line for line in status.read_text().splitlines() if line.startswith("PPid:")).split()[1])
            cmdline = (status.parent / "cmdline").read_text()
        except (OSError, StopIteration):
            continue
        if ppid == parent and marker in cmdline and alive(int(status.parent.name)):
            found.append(int(status.parent.name))
    return found
