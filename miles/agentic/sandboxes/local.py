"""The builtin ``local`` sandbox: shell commands in a fresh workspace on this machine.

With bubblewrap (``isolation: bwrap``, what ``auto`` picks when it works here) every run gets a
read-only view of the root filesystem with only the workspace writable, a private ``/tmp``, no
network and its own pid namespace. Without it (``isolation: subprocess``) a run is a plain process
group in the workspace: the same limits, but no network or filesystem isolation.

Both modes apply rlimits (CPU seconds, address space, file size), kill a run's whole process tree at
its wall-clock timeout and when it ends (nothing a run starts outlives it; the workspace is what
persists between runs), cap stdout and stderr, and die with the thread that started them
(``PR_SET_PDEATHSIG``, bwrap's ``--die-with-parent`` and a lifeline pipe, which also covers the moments
before those are in place). When Miles runs as root, commands run as ``nobody``.

The process limit (``RLIMIT_NPROC``, what contains a fork bomb) is bwrap mode's only. The kernel counts
it per user and exempts root; bwrap run as nobody sets it inside the sandbox's own user namespace,
where it counts that run's processes only. In subprocess mode it would count every process of the
user (all concurrent runs, or all of a normal user's processes), so it is not set there.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import os
import resource
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any
from pathlib import PurePosixPath

from miles.agentic.types import CUT_MARKER, ExecResult

__all__ = ["ISOLATIONS", "LocalSandbox", "describe_isolation"]

log = logging.getLogger(__name__)

ISOLATIONS = ("auto", "bwrap", "subprocess")
NOBODY = 65534  # the uid and gid commands run as when Miles runs as root
DRAIN_GRACE_S = 2.0  # how long a run waits for its output pipes to close after its processes are killed
_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: a child between fork and exec must not dlsym


class LocalSandbox:
    """Runs shell commands (``/bin/sh -c``) in a workspace of its own; see the module docstring.

    ``cpu_s``, ``memory_mb`` (address space) and ``file_mb`` (largest file) are rlimits of every process
    a command starts, ``max_procs`` limits a run's processes (bwrap mode), ``output_bytes`` caps stdout
    and stderr each. ``workspace_root`` is where workspaces are made (default: the system temp dir; when
    Miles runs as root, uid nobody must be able to reach it).

    ``mounts`` (bwrap mode) are absolute folders inside the sandbox, writable and kept between runs, for
    tasks that expect their files at fixed paths (``/app``, ``/tests``): mount ``/app`` is the workspace's
    ``app`` folder, and ``files`` may name paths inside a mount. Their top-level folder must not exist on
    this machine (the sandbox's root is then this machine's top-level folders, read-only, beside them).
    ``cwd`` is where commands start (a mount or a folder in one; default: the workspace).
    """

    def __init__(self, *, isolation: str = "auto", cpu_s: int = 10, memory_mb: int = 1024, file_mb: int = 64,
                 max_procs: int = 64, output_bytes: int = 65536, workspace_root: str | None = None,
                 mounts: list[str] | tuple[str, ...] = (), cwd: str | None = None) -> None:
        for name, value in (("cpu_s", cpu_s), ("memory_mb", memory_mb), ("file_mb", file_mb),
                            ("max_procs", max_procs), ("output_bytes", output_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        if workspace_root is not None and not os.path.isdir(workspace_root):
            raise ValueError(f"workspace_root: expected an existing directory, got {workspace_root!r}")
        self.isolation = resolve_isolation(isolation)
        self.mounts = _check_mounts(mounts, self.isolation)
        if cwd is not None and self._mounted(cwd) is None:
            raise ValueError(f"cwd: expected one of the mounts {list(self.mounts)} or a folder in one, got {cwd!r}")
        self.cwd = cwd
        self.output_bytes = output_bytes
        self.max_procs = max_procs
        self.workspace_root = workspace_root
        self._rlimits = [(resource.RLIMIT_CPU, cpu_s, cpu_s + 1),  # soft: SIGXCPU, hard: SIGKILL
                         (resource.RLIMIT_AS, memory_mb << 20, memory_mb << 20),
                         (resource.RLIMIT_FSIZE, file_mb << 20, file_mb << 20)]
        self._workspace: str | None = None  # made on the first run
        self._running: set[asyncio.SubprocessTransport] = set()
        self._closed = False

    @classmethod
    def check_args(cls, args: dict[str, object]) -> None:
        """Config validation: the constructor's checks (a ValueError names the argument)."""
        cls(**args)  # type: ignore[arg-type]

    @classmethod
    def describe(cls, **config: object) -> str:
        """How commands of a sandbox with this config are isolated here, in one line (for the run's start;
        a bad argument raises ValueError as the constructor does)."""
        return describe_isolation(cls(**config).isolation)  # type: ignore[arg-type]

    async def run(self, command: str, *, timeout_s: float, files: dict[str, bytes] | None = None) -> ExecResult:
        """Write ``files`` (paths relative to the workspace) and run ``command`` with ``/bin/sh -c``."""
        if self._closed:
            raise RuntimeError("this sandbox is closed")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: expected a positive number of seconds, got {timeout_s!r}")
        workspace = self._ensure_workspace()
        for path, data in (files or {}).items():
            _write_file(workspace, self._relative(path), data.encode() if isinstance(data, str) else data, self._owner)
        started = time.monotonic()
        # A watcher in the run's process group kills the group when this pipe closes: when this process
        # dies, also before --die-with-parent and the pdeathsig are in place.
        stdin, lifeline = os.pipe()
        try:
            transport, output = await asyncio.get_running_loop().subprocess_exec(
                lambda: _Output(self.output_bytes), *self._argv(workspace), "/bin/sh", "-c", _WITH_LIFELINE,
                "sh", command, **_spawn_options(workspace, self._child_setup(), stdin))
        except BaseException:
            os.close(lifeline)
            raise
        finally:
            os.close(stdin)
        self._running.add(transport)
        if self._closed:  # close() came while the process was starting
            _kill_group(transport)
        timed_out = False
        try:
            try:
                await asyncio.wait_for(output.exited.wait(), timeout_s)
            except asyncio.TimeoutError:
                timed_out = True
            _kill_group(transport)  # background processes end with the run; their pipes close
            try:
                await asyncio.wait_for(output.closed.wait(), DRAIN_GRACE_S)
            except asyncio.TimeoutError:
                pass  # a process that left the group (subprocess mode) holds a pipe: stop reading it
        finally:
            _kill_group(transport)
            transport.close()
            self._running.discard(transport)
            os.close(lifeline)
        code = transport.get_returncode()
        exit_code = None if timed_out else (128 - code if code is not None and code < 0 else code)
        return ExecResult(output.stdout.text(), output.stderr.text(), exit_code, timed_out, time.monotonic() - started)

    async def read_file(self, path: str) -> bytes:
        """The file at ``path`` (relative to the workspace, or inside a mount), without following symlinks."""
        if self._closed:
            raise RuntimeError("this sandbox is closed")
        return await asyncio.to_thread(_read_file, self._ensure_workspace(), self._relative(path))

    async def close(self) -> None:
        """Kill whatever still runs and remove the workspace (idempotent)."""
        self._closed = True
        for transport in list(self._running):
            _kill_group(transport)
        workspace, self._workspace = self._workspace, None
        if workspace is not None:
            await asyncio.to_thread(_remove_tree, workspace)

    # -- internals ------------------------------------------------------------------------------------

    @property
    def _owner(self) -> tuple[int, int] | None:
        """Who commands run as, when that is not us (Miles runs as root)."""
        return (NOBODY, NOBODY) if os.geteuid() == 0 else None

    def _ensure_workspace(self) -> str:
        if self._workspace is None:
            self._workspace = tempfile.mkdtemp(prefix="miles-sandbox-", dir=self.workspace_root)
            if self._owner:
                os.chown(self._workspace, *self._owner)
            for mount in self.mounts:
                _write_below(self._workspace, PurePosixPath(mount).parts[1:], None, self._owner)
        return self._workspace

    def _mounted(self, path: str) -> str | None:
        """``path`` inside a mount as a path relative to the workspace, else None."""
        pure = PurePosixPath(path)
        for mount in self.mounts:
            if pure == PurePosixPath(mount) or PurePosixPath(mount) in pure.parents:
                return str(pure.relative_to("/"))
        return None

    def _relative(self, path: str) -> str:
        if PurePosixPath(path).is_absolute():
            inside = self._mounted(path)
            if inside is None or ".." in PurePosixPath(path).parts:
                raise ValueError(f"files: expected a path relative to the workspace or inside a mount "
                                 f"{list(self.mounts)}, got {path!r}")
            return inside
        return path

    def _argv(self, workspace: str) -> list[str]:
        if self.isolation != "bwrap":
            return []
        return _bwrap_argv(workspace, self.max_procs, self.mounts, self.cwd)

    def _child_setup(self) -> Callable[[], None]:
        return functools.partial(_child_setup, os.getpid(), self._rlimits)


class _Output(asyncio.SubprocessProtocol):
    """A run's stdout and stderr, capped, and events for "the command exited" and "the pipes closed"."""

    def __init__(self, cap: int) -> None:
        self.stdout, self.stderr = _Capped(cap), _Capped(cap)
        self.exited, self.closed = asyncio.Event(), asyncio.Event()

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        (self.stdout if fd == 1 else self.stderr).add(data)

    def process_exited(self) -> None:
        self.exited.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed.set()


class _Capped:
    """The first ``cap`` bytes of a stream and a count of the rest."""

    def __init__(self, cap: int) -> None:
        self.cap, self.kept, self.cut = cap, bytearray(), 0

    def add(self, data: bytes) -> None:
        room = max(0, self.cap - len(self.kept))
        self.kept += data[:room]
        self.cut += max(0, len(data) - room)

    def text(self) -> str:
        text = self.kept.decode(errors="replace")
        return text + CUT_MARKER.format(self.cut) if self.cut else text


def _bwrap_argv(workspace: str, max_procs: int, mounts: tuple[str, ...] = (), cwd: str | None = None) -> list[str]:
    """bwrap and its options, ending where the command goes. The process limit is set inside the new
    user namespace (by prlimit) so that it counts this sandbox's processes only.

    No ``--new-session``: bwrap is started in a session of its own, without a controlling terminal (what
    that option protects against), and so the sandbox's init stays in the process group a run kills.

    With mounts, the root is bwrap's own tmpfs holding this machine's top-level folders read-only, so
    that the mounts' folders can be made beside them."""
    root = ["--ro-bind", "/", "/"] if not mounts else _top_level_binds()
    binds = [arg for mount in mounts for arg in ("--bind", os.path.join(workspace, mount.lstrip("/")), mount)]
    return ["bwrap", *root, "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
            "--bind", workspace, workspace, *binds, "--chdir", cwd or workspace, "--unshare-all",
            "--die-with-parent", "--", "prlimit", f"--nproc={max_procs}", "--"]


def _top_level_binds() -> list[str]:
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


def _check_mounts(mounts: Any, isolation: str) -> tuple[str, ...]:
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


# The lifeline is stdin; a background list gets /dev/null as stdin, so it reads a copy (fd 3). The command
# itself gets neither.
_WITH_LIFELINE = 'exec 3<&0; (read x <&3; kill -9 0) & exec /bin/sh -c "$1" 3<&- </dev/null'


def _spawn_options(workspace: str, preexec_fn: Callable[[], None], stdin: int = subprocess.DEVNULL) -> dict:
    """How every command is started: its own session (its process group is killed as a whole; no
    controlling terminal), a small environment (no secrets of the trainer's), as nobody when we are root."""
    env = {"PATH": os.environ.get("PATH", os.defpath), "HOME": workspace, "TMPDIR": "/tmp", "LANG": "C.UTF-8"}
    options = dict(stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=workspace,
                   env=env, start_new_session=True, preexec_fn=preexec_fn)
    if os.geteuid() == 0:
        options.update(user=NOBODY, group=NOBODY, extra_groups=[])
    return options


def _child_setup(parent_pid: int, limits: list[tuple[int, int, int]]) -> None:
    """Runs in the child between fork and exec (after the uid change, which would clear it): die with
    the parent thread, then lower the rlimits."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl
        os._exit(1)
    for limit, soft, hard in limits:
        resource.setrlimit(limit, (soft, hard))


def _kill_group(transport: asyncio.SubprocessTransport) -> None:
    """SIGKILL the run's process group (its session). In bwrap mode the group holds bwrap and the
    sandbox's init, whose death ends everything in the sandbox's pid namespace."""
    try:
        os.killpg(transport.get_pid(), signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nothing of the group is left


def _write_file(workspace: str, path: str, data: bytes, owner: tuple[int, int] | None) -> None:
    """Write ``data`` at ``path`` inside ``workspace``, never following a symlink (a command may have
    left one to point outside) and writing regular files only."""
    parts = PurePosixPath(path).parts
    if not parts or PurePosixPath(path).is_absolute() or ".." in parts:
        raise ValueError(f"files: expected a path relative to the workspace, got {path!r}")
    try:
        _write_below(workspace, parts, data, owner)
    except OSError as exc:  # e.g. ELOOP: a symlink on the way
        raise ValueError(f"files: cannot write {path!r} in the workspace: {exc}") from exc


def _read_file(workspace: str, path: str) -> bytes:
    """The regular file at ``path`` inside ``workspace``, never following a symlink."""
    parts = PurePosixPath(path).parts
    if not parts or PurePosixPath(path).is_absolute() or ".." in parts:
        raise ValueError(f"read_file: expected a path relative to the workspace, got {path!r}")
    dir_fd = os.open(workspace, os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for part in parts[:-1]:
            next_fd = os.open(part, os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
            os.close(dir_fd)
            dir_fd = next_fd
        fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
        with open(fd, "rb") as file:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError(f"read_file: {path!r} is not a regular file")
            return file.read()
    finally:
        os.close(dir_fd)


def _write_below(workspace: str, parts: tuple[str, ...], data: bytes | None, owner: tuple[int, int] | None) -> None:
    """Write ``data`` at ``parts`` below ``workspace``, making folders on the way (``data`` None: make
    ``parts`` as a folder)."""
    if data is None:
        parts = (*parts, "")
    dir_fd = os.open(workspace, os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for part in parts[:-1]:
            try:
                os.mkdir(part, 0o755, dir_fd=dir_fd)
                if owner:
                    os.chown(part, *owner, dir_fd=dir_fd, follow_symlinks=False)
            except FileExistsError:
                pass
            next_fd = os.open(part, os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
            os.close(dir_fd)
            dir_fd = next_fd
        if data is None:
            return
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK
        fd = os.open(parts[-1], flags, 0o644, dir_fd=dir_fd)
        with open(fd, "wb") as file:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError("it exists and is not a regular file")
            if owner:
                os.fchown(fd, *owner)
            file.write(data)
    finally:
        os.close(dir_fd)


def _remove_tree(path: str) -> None:
    """Remove a workspace, also when a command left directories without write permission."""
    try:
        shutil.rmtree(path)
    except OSError:
        for root, dirs, _ in os.walk(path):
            for name in dirs:
                if not os.path.islink(os.path.join(root, name)):
                    os.chmod(os.path.join(root, name), 0o700)
        shutil.rmtree(path, ignore_errors=True)


# -- which isolation --------------------------------------------------------------------------------------


@functools.cache
def bwrap_problem() -> str | None:
    """None when bwrap runs a command here the way LocalSandbox runs it, else why not (probed once)."""
    if shutil.which("bwrap") is None:
        return "bwrap is not installed"
    workspace = tempfile.mkdtemp(prefix="miles-sandbox-probe-")
    try:
        if os.geteuid() == 0:
            os.chown(workspace, NOBODY, NOBODY)
        options = _spawn_options(workspace, functools.partial(_child_setup, os.getpid(), []))
        done = subprocess.run([*_bwrap_argv(workspace, 64), "true"], **options, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        shutil.rmtree(workspace, ignore_errors=True)
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
