"""How a local sandbox starts a command (:mod:`.local`): bubblewrap's arguments, the limits and the death signal a
child sets up before it runs the command, a command's state (lifeline, output), and which isolation works here."""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import os
import resource
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Any

from miles.agentic.sandboxes import storage
from miles.agentic.sandboxes.interpreter import Capped

__all__ = ["ISOLATIONS", "NOBODY", "Output", "Run", "bwrap_argv", "bwrap_problem", "check_mounts", "child_setup",
           "describe_isolation", "resolve_isolation", "spawn_options", "WATCH_LIFELINE"]

log = logging.getLogger("miles.agentic.sandboxes.local")

ISOLATIONS = ("auto", "bwrap", "subprocess")
NOBODY = 65534  # the uid and gid commands run as when Miles runs as root
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: a child between fork and exec must not dlsym


def bwrap_argv(workspace: str, tmp: str, shm: str, max_procs: int, mounts: tuple[str, ...] = (),
               cwd: str | None = None) -> list[str]:
    """bwrap and its options, ending where the command goes. ``tmp`` and ``shm`` (folders of the sandbox's
    directory, counted by the disk quota) are the run's ``/tmp`` and ``/dev/shm``. The process limit is set inside
    the new user namespace (by prlimit) so that it counts this sandbox's processes only.

    bwrap's ``/dev`` is a tmpfs: it is made read-only once its mounts are in place, so that nothing is written in
    memory no quota counts and nothing of a run is left there (its devices, ``/dev/pts`` and ``/dev/mqueue`` work as
    before). With mounts, the root is bwrap's own tmpfs holding this machine's top-level folders read-only, so
    that the mounts' folders can be made beside them; it is made read-only too.

    No ``--new-session``: bwrap is started in a session of its own, without a controlling terminal (what
    that option protects against), and so the sandbox's init stays in the process group a run kills."""
    root = ["--ro-bind", "/", "/"] if not mounts else top_level_binds()
    binds = [arg for mount in mounts for arg in ("--bind", os.path.join(workspace, mount.lstrip("/")), mount)]
    read_only = ["--remount-ro", "/dev", *(["--remount-ro", "/"] if mounts else [])]
    return ["bwrap", *root, "--dev", "/dev", "--bind", shm, "/dev/shm", "--mqueue", "/dev/mqueue", "--proc", "/proc",
            "--bind", tmp, "/tmp", "--bind", workspace, workspace, *binds, *read_only, "--chdir", cwd or workspace,
            "--unshare-all", "--die-with-parent", "--", "prlimit", f"--nproc={max_procs}", "--"]


def top_level_binds() -> list[str]:
    argv = []
    for name in sorted(os.listdir("/")):
        path = "/" + name
        if name in ("proc", "dev", "tmp"):
            continue
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    return argv


def check_mounts(mounts: Any, isolation: str) -> tuple[str, ...]:
    """The mounts, checked: absolute, normalised, distinct top-level folders this machine does not have."""
    if isinstance(mounts, str) or not all(isinstance(m, str) for m in mounts):
        raise ValueError(f"mounts: expected a list of absolute paths, got {mounts!r}")
    if mounts and isolation != "bwrap":
        raise ValueError(f"mounts: need isolation bwrap (this sandbox runs with {isolation}): {list(mounts)}")
    for mount in mounts:
        pure = PurePosixPath(mount)
        if not pure.is_absolute() or ".." in pure.parts or len(pure.parts) < 2 or str(pure) != mount.rstrip("/"):
            raise ValueError(f"mounts: expected absolute, normalised paths below /, got {mount!r}")
        if os.path.lexists("/" + pure.parts[1]):
            raise ValueError(f"mounts: {mount!r}: /{pure.parts[1]} exists on this machine; mounts go in "
                             f"top-level folders it does not have (e.g. /app, /tests, /logs)")
    return tuple(m.rstrip("/") for m in mounts)


# bwrap mode's start: the lifeline (stdin) moves to fd 3 of a background watcher that SIGKILLs the process
# group when it closes; then bwrap ("$@") replaces the shell, in the same group, with /dev/null as stdin.
WATCH_LIFELINE = 'exec 3<&0 </dev/null; (read x <&3; kill -9 0) >/dev/null 2>&1 & exec "$@" 3<&-'


def spawn_options(workspace: str, preexec_fn: Callable[[], None], stdin: int = subprocess.DEVNULL, *,
                   tmp: str = "/tmp", as_nobody: bool = True) -> dict:
    """How every command is started: its own session (no controlling terminal; in bwrap mode its process
    group is killed as a whole), a small environment (no secrets of the trainer's), as nobody when we are
    root (``as_nobody``; the subprocess-mode reaper stays root and starts the command as nobody)."""
    env = {"PATH": os.environ.get("PATH", os.defpath), "HOME": workspace, "TMPDIR": tmp, "LANG": "C.UTF-8"}
    options = dict(stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=workspace,
                   env=env, start_new_session=True, preexec_fn=preexec_fn)
    if os.geteuid() == 0 and as_nobody:
        options.update(user=NOBODY, group=NOBODY, extra_groups=[])
    return options


def child_setup(parent_pid: int, limits: list[tuple[int, int, int]], death_signal: int,
                 subreaper: bool = False) -> Callable[[], None]:
    """What runs in the child between fork and exec (after the uid change, which would clear the death
    signal): get ``death_signal`` when the parent thread dies, become a child subreaper (the reaper),
    then lower the rlimits."""
    return functools.partial(in_child, parent_pid, limits, death_signal, subreaper)


def in_child(parent_pid: int, limits: list[tuple[int, int, int]], death_signal: int, subreaper: bool) -> None:
    _prctl(_PR_SET_PDEATHSIG, death_signal)
    if subreaper:
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    if os.getppid() != parent_pid:  # the parent died before prctl
        os._exit(1)
    for limit, soft, hard in limits:
        resource.setrlimit(limit, (soft, hard))


# -- a command's state ------------------------------------------------------------------------------------


class Run:
    """One command of a sandbox: its private folder (its ``/tmp`` and ``/dev/shm``), its lifeline (closing our end
    tells the watcher or reaper to kill everything of the run), its processes, and its disk baseline."""

    def __init__(self, folder: str, *, baseline: int, bwrap: bool) -> None:
        self.folder: str | None = folder  # None once removed
        self.baseline, self.bwrap = baseline, bwrap  # baseline: the sandbox's disk use when the run started
        self.lifeline_in, self._lifeline = os.pipe()
        self.transport: asyncio.SubprocessTransport | None = None
        self.over_quota: int | None = None  # the disk use that stopped it
        self.done = asyncio.Event()
        self._killed = False

    def close_lifeline_in(self) -> None:
        """Close our copy of the lifeline's read end (the started process holds its own)."""
        if self.lifeline_in >= 0:
            os.close(self.lifeline_in)
            self.lifeline_in = -1

    def stop(self) -> None:
        """End the run: close the lifeline; in bwrap mode also SIGKILL the process group at once (it holds
        bwrap and the sandbox's init, whose death ends everything in its pid namespace). The subprocess-mode
        reaper is never SIGKILLed: it must live to kill what the command started. Idempotent."""
        if self._lifeline >= 0:
            os.close(self._lifeline)
            self._lifeline = -1
        if self.bwrap and self.transport is not None and not self._killed:
            self._killed = True  # once: SIGKILLed processes start no more, and the group's id could be reused
            try:
                os.killpg(self.transport.get_pid(), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass  # nothing of the group is left


class Output(asyncio.SubprocessProtocol):
    """A run's stdout and stderr, capped, and events for "the command exited" and "the pipes closed"."""

    def __init__(self, cap: int) -> None:
        self.stdout, self.stderr = Capped(cap), Capped(cap)
        self.exited, self.closed = asyncio.Event(), asyncio.Event()

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        (self.stdout if fd == 1 else self.stderr).add(data)

    def process_exited(self) -> None:
        self.exited.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed.set()


# -- which isolation --------------------------------------------------------------------------------------


@functools.cache
def bwrap_problem() -> str | None:
    """None when bwrap runs a command here the way LocalSandbox runs it, else why not (probed once)."""
    if shutil.which("bwrap") is None:
        return "bwrap is not installed"
    root = tempfile.mkdtemp(prefix="miles-sandbox-probe-")
    try:
        os.chmod(root, 0o711)
        owner = (NOBODY, NOBODY) if os.geteuid() == 0 else None
        workspace, tmp, shm = (os.path.join(root, name) for name in ("work", "tmp", "shm"))
        for folder in (workspace, tmp, shm):
            storage.make_folder(folder, owner)
        options = spawn_options(workspace, child_setup(os.getpid(), [], signal.SIGKILL))
        done = subprocess.run([*bwrap_argv(workspace, tmp, shm, 64), "true"], **options, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        storage.remove_tree(root)
    if done.returncode != 0:
        return done.stderr.decode(errors="replace").strip() or f"bwrap exited with code {done.returncode}"
    return None


@functools.cache
def resolve_isolation(isolation: str) -> str:
    """``bwrap`` or ``subprocess`` for a configured ``isolation``; ``auto`` warns (once) when it falls
    back to subprocess."""
    if isolation not in ISOLATIONS:
        raise ValueError(f"isolation: expected one of {', '.join(ISOLATIONS)}, got {isolation!r}")
    if isolation == "subprocess":
        return isolation
    problem = bwrap_problem()
    if problem is None:
        return "bwrap"
    if isolation == "bwrap":
        raise ValueError(f"isolation: 'bwrap' does not work here ({problem}); install bubblewrap "
                         f"(apt-get install bubblewrap) or set isolation: subprocess")
    log.warning("the local sandbox is NOT isolated: bwrap does not work here (%s), so commands run as plain "
                "processes with rlimits but no network or filesystem isolation. Install bubblewrap "
                "(apt-get install bubblewrap) and allow user namespaces to isolate them.", problem)
    return "subprocess"


def describe_isolation(isolation: str = "auto") -> str:
    """One line saying how ``LocalSandbox(isolation=...)`` isolates commands here (for the run's start)."""
    user = " as nobody" if os.geteuid() == 0 else ""
    if resolve_isolation(isolation) == "bwrap":
        return (f"local sandbox: bubblewrap{user} (read-only root, writable workspace, private /tmp, no network, "
                f"own pid namespace, rlimits incl. a process limit)")
    return (f"local sandbox: subprocess{user}, NOT isolated (no network or filesystem isolation, no process "
            f"limit; rlimits on CPU, memory and file size); install bubblewrap to isolate it")
