"""The reaper of a local Ray instance: nothing of it outlives the run that started it.

A run that starts Ray starts this script first (standard library only: it runs as a file, not as part of the
package, so it starts in milliseconds), in a session of its own with its stdin a pipe from the run. When the
pipe ends (the run called :meth:`miles.cluster.RayCluster.shutdown`, or died, even by SIGKILL) it kills every
process that still uses the instance's temp folder and removes the folder when it lies outside the run
directory. Without it a SIGKILLed driver left ``ray::DashboardAgent`` and ``ray::RuntimeEnvAgent`` running for
about a minute, and a temp folder under /tmp for ever.

A Ray process is known by the folder: each keeps its log files there open (Ray rewrites the command lines of
its workers and agents, ``ray::DashboardAgent``, so they do not name it).

    python miles/_ray_reaper.py TEMP_DIR [--remove]
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time

__all__ = ["processes_using", "reap", "unused"]


def processes_using(folder: str, spare: frozenset[int] = frozenset()) -> list[int]:
    """Pids of the processes (but this one and ``spare``) with a file open under ``folder``, their working
    directory there, or ``folder`` on their command line."""
    folder = os.path.realpath(folder)
    prefix = folder.rstrip("/") + "/"
    return [pid for pid, command, paths in _processes() if pid not in spare
            and (folder.encode() in command or any(p == folder or p.startswith(prefix) for p in paths))]


def _processes() -> list[tuple[int, bytes, list[str]]]:
    """(pid, command line, working directory and open files) of every process we may read, but this one."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        proc = f"/proc/{name}"
        try:
            with open(f"{proc}/cmdline", "rb") as f:
                command = f.read()
            paths = [os.readlink(f"{proc}/cwd")]
            for fd in os.listdir(f"{proc}/fd"):
                try:
                    paths.append(os.readlink(f"{proc}/fd/{fd}"))
                except OSError:
                    continue
        except OSError:  # gone meanwhile, or not ours to read
            continue
        out.append((int(name), command, paths))
    return out


def unused(folders: list[str]) -> list[str]:
    """Those of ``folders`` that no process uses (one look at every process for all of them)."""
    processes = _processes()
    found = []
    for folder in folders:
        real = os.path.realpath(folder)
        prefix = real.rstrip("/") + "/"
        if not any(real.encode() in command or any(p == real or p.startswith(prefix) for p in paths)
                   for _, command, paths in processes):
            found.append(folder)
    return found


def reap(folder: str, remove: bool, spare: frozenset[int] = frozenset()) -> int:
    """SIGKILL what uses ``folder`` (but ``spare``) until nothing does (a process may start another as it goes);
    the count."""
    killed: set[int] = set()
    for _ in range(100):
        pids = processes_using(folder, spare)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.05)  # the kernel closes a killed process's files as it exits
    if remove:
        shutil.rmtree(folder, ignore_errors=True)
    return len(killed)


def main(argv: list[str]) -> int:
    folder, remove = argv[0], "--remove" in argv[1:]
    run = frozenset({os.getppid()})  # the run itself, when it shut Ray down and lives on (a test, a notebook)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # Ctrl-C and a terminal that closes stop the run, not its reaper
    while sys.stdin.buffer.read(1 << 16):
        pass
    reap(folder, remove, spare=run)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
