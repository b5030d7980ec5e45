"""The builtin ``local`` sandbox: shell commands in a fresh workspace on this machine.

With bubblewrap (``isolation: bwrap``, what ``auto`` picks when it works here) every run gets a
read-only view of the root filesystem with only the workspace writable, a private ``/tmp``, no
network and its own pid namespace. Without it (``isolation: subprocess``) a run is a plain process
tree in the workspace: the same limits, but no network or filesystem isolation.

Both modes apply rlimits (CPU seconds, address space, file size), kill a run's whole process tree at
its wall-clock timeout, when it ends and when the sandbox closes (nothing a run starts outlives it; the
workspace is what persists between runs), cap stdout and stderr, and die with Miles. What holds a run's
processes together:

- bwrap mode: the run's pid namespace. Its init is in the run's process group, and when it dies the
  kernel kills everything in the namespace, also processes that left the group (``setsid``). A
  watcher started *before* bwrap, in the same group, kills the group when the run's lifeline pipe
  closes (Miles ended the run or died): bwrap's own ``--die-with-parent`` comes too late for its
  namespace child, which, when bwrap dies between creating it and releasing it, would otherwise wait
  forever on an eventfd.
- subprocess mode: a reaper (:mod:`._reaper`), a child subreaper that starts the command and, when it
  ends or the lifeline closes, kills every process the command started. An orphan is re-parented to it
  and cannot leave it, as it can leave a process group or session.

The disk quota (``disk_mb``) bounds what the sandbox holds: its workspace and each run's private
temporary folders (``/tmp`` and ``/dev/shm`` in bwrap mode, ``$TMPDIR`` in subprocess mode), all folders of the
sandbox's own directory on disk; nothing else in bwrap mode is writable (its ``/dev``, a tmpfs, is read-only but
for those mounts and the devices). No file may grow past the quota (``RLIMIT_FSIZE``); the sum is
measured every ``DISK_CHECK_S`` while commands run and when each ends, and a run that took the sandbox
over the quota is stopped and fails, with a line saying so. The sandbox stays usable: a later command
may remove files (a run that started over the quota is stopped only if it grows it further). Measured,
because nothing the kernel enforces is at hand without privileges: a sized tmpfs would not outlive a
run (and holds memory), filesystem quotas need an administrator; so the sum may go past the quota by
what a command writes between two measurements.

When Miles runs as root, commands run as ``nobody`` (the subprocess-mode reaper stays root, so a command
can neither kill nor stop it). The process limit (``RLIMIT_NPROC``, what contains a fork bomb) is bwrap
mode's only. The kernel counts it per user and exempts root; bwrap run as nobody sets it inside the
sandbox's own user namespace, where it counts that run's processes only. In subprocess mode it would
count every process of the user (all concurrent runs, or all of a normal user's processes), so it is not
set there.

The persistent interpreter (:mod:`.interpreter`): ``run_python`` runs Python code in one Python process that
lives in the sandbox between calls, in globals it keeps, as hosted code interpreters do; it starts on the first
call. With ``warm: true`` it starts when the sandbox does (:meth:`LocalSandbox.start`, what a pool does ahead of
time) and shell commands run in it too: one bwrap (or reaper) for the sandbox's life, not one per command. Its
calls run one at a time, with the same isolation and limits (``cpu_s`` of CPU per call), and share the sandbox's
``/tmp``; a Python call waits for the one before, a shell command that comes meanwhile runs as without ``warm``.
Every process a call starts ends with the call. A call that times out, or whose interpreter dies (killed,
``os._exit``, out of CPU time, over the disk quota), replaces it with a fresh one and ends its stderr with
RESTART_MARKER: the variables are gone, the files stay.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import signal
import sys
import tempfile
import time
from pathlib import PurePosixPath

from miles.agentic.sandboxes import processes, storage
from miles.agentic.sandboxes.interpreter import (CHANNEL_FD, RESTART_MARKER, WATCH_LIFELINE, Interpreter, ResetError,
                                                 WarmCall, server_source)
from miles.agentic.sandboxes.processes import ISOLATIONS, NOBODY, bwrap_problem, describe_isolation, resolve_isolation
from miles.agentic.types import ExecResult

__all__ = ["ISOLATIONS", "QUOTA_MARKER", "LocalSandbox", "bwrap_problem", "describe_isolation"]

log = logging.getLogger(__name__)

DRAIN_GRACE_S = 2.0  # how long a run waits for its processes to go and its output pipes to close once it ends
DISK_CHECK_S = 0.1  # how often the disk use of a sandbox with a command running is measured
QUOTA_EXIT_CODE = 1  # the exit code of a run that took its sandbox over the disk quota
# Ends the stderr of such a run; {used}: what the sandbox held, {limit}: disk_mb.
QUOTA_MARKER = ("\n[sandbox: disk quota exceeded: the sandbox held {used}, more than disk_mb={limit}; the command "
                "was stopped. Remove files to go on]")
REAPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_reaper.py")


class LocalSandbox:
    """Runs shell commands (``/bin/sh -c``) in a workspace of its own; see the module docstring.

    ``cpu_s``, ``memory_mb`` (address space) and ``file_mb`` (largest file) are rlimits of every process
    a command starts, ``max_procs`` limits a run's processes (bwrap mode), ``output_bytes`` caps stdout
    and stderr each, ``disk_mb`` is the disk quota of the whole sandbox (workspace and the runs' temporary
    folders). ``workspace_root`` is where the sandbox's directory is made (default: the system temp dir;
    when Miles runs as root, uid nobody must be able to reach it).

    ``mounts`` (bwrap mode) are absolute folders inside the sandbox, writable and kept between runs, for
    tasks that expect their files at fixed paths (``/app``, ``/tests``): mount ``/app`` is the workspace's
    ``app`` folder, and ``files`` may name paths inside a mount. Their top-level folder must not exist on
    this machine (the sandbox's root is then this machine's top-level folders, read-only, beside them).
    ``cwd`` is where commands start (a mount or a folder in one; default: the workspace). ``warm``: start the
    persistent interpreter with the sandbox and run shell commands in it (see the module docstring).
    """

    def __init__(self, *, isolation: str = "auto", cpu_s: int = 10, memory_mb: int = 1024, file_mb: int = 64,
                 max_procs: int = 64, output_bytes: int = 65536, disk_mb: int = 1024,
                 workspace_root: str | None = None, mounts: list[str] | tuple[str, ...] = (),
                 cwd: str | None = None, warm: bool = False) -> None:
        for name, value in (("cpu_s", cpu_s), ("memory_mb", memory_mb), ("file_mb", file_mb),
                            ("max_procs", max_procs), ("output_bytes", output_bytes), ("disk_mb", disk_mb)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        if not isinstance(warm, bool):
            raise ValueError(f"warm: expected true or false, got {warm!r}")
        if workspace_root is not None and not os.path.isdir(workspace_root):
            raise ValueError(f"workspace_root: expected an existing directory, got {workspace_root!r}")
        self.isolation = resolve_isolation(isolation)
        self.mounts = processes.check_mounts(mounts, self.isolation)
        if cwd is not None and self._mounted(cwd) is None:
            raise ValueError(f"cwd: expected one of the mounts {list(self.mounts)} or a folder in one, got {cwd!r}")
        self.cwd = cwd
        self.output_bytes = output_bytes
        self.max_procs = max_procs
        self.disk_mb = disk_mb
        self.workspace_root = workspace_root
        self.warm, self._cpu_s = warm, cpu_s
        self._interpreter: Interpreter | None = None  # the persistent interpreter, once started
        self._first: Interpreter | None = None  # the one start() started in a new sandbox: reset() puts that back
        self.spoiled: str | None = None  # why the sandbox may not be reused: a call hit a limit (see reset())
        self._lock: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None  # its calls' queue, per loop
        largest_file = min(file_mb, disk_mb) << 20  # no single file may take more than the whole quota
        self._rlimits = [(resource.RLIMIT_CPU, cpu_s, cpu_s + 1),  # soft: SIGXCPU, hard: SIGKILL
                         (resource.RLIMIT_AS, memory_mb << 20, memory_mb << 20),
                         (resource.RLIMIT_FSIZE, largest_file, largest_file)]
        self._root: str | None = None  # the sandbox's directory: workspace and run folders; made on the first run
        self._disk_used = 0  # what the quota counted in it when last measured, and the files written since
        self._runs: set[processes.Run] = set()
        self._runs_started = 0
        self._disk_watch: asyncio.Task | None = None
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

    async def start(self) -> None:
        """Make the workspace and, with ``warm``, start the persistent interpreter (a pool calls it ahead of use)."""
        if self._closed:
            raise RuntimeError("this sandbox is closed")
        new = self._root is None
        self._ensure_workspace()
        if self.warm:
            async with self._call_lock():
                interpreter = await self._ensure_interpreter()
                self._first = interpreter if new else None

    @property
    def reusable(self) -> bool:
        """Whether :meth:`reset` can put it back (a pool reuses it): warm, in bwrap isolation."""
        return self.warm and self.isolation == "bwrap"

    async def reset(self) -> None:
        """Put the sandbox back as :meth:`start` left it, for another trajectory (what a pool does when one ends):
        every process but the interpreter's zygote killed, the workspace, ``/tmp``, ``/dev/shm``, ``/dev/mqueue``
        and ``/dev/pts`` as they were (what they hold, and the modes, extended attributes and times of what stayed),
        a new interpreter session (:meth:`.Interpreter.reset`). ResetError when that cannot be done or
        verified, or the sandbox hit a limit since (``spoiled``): it must then be closed, not reused."""
        why = ("it is closed" if self._closed else "it is not warm" if not self.warm else
               "it was not started by start()" if self._first is None else
               "its interpreter was replaced" if self._interpreter is not self._first else
               f"a call hit a limit: {self.spoiled}" if self.spoiled else
               "a command runs beside the interpreter" if self._runs else None)
        if why is not None:
            raise ResetError(why)
        async with self._call_lock():
            await self._first.reset()
            self._disk_used = await asyncio.to_thread(storage.disk_use, self._root)

    async def run(self, command: str, *, timeout_s: float, files: dict[str, bytes] | None = None) -> ExecResult:
        """Write ``files`` (paths relative to the workspace) and run ``command`` with ``/bin/sh -c``."""
        if self.warm and not self._closed and not self._call_lock().locked():  # busy: a run of its own, as cold
            return await self._warm_call({"shell": command}, timeout_s, files)
        self._before_call(timeout_s, files)
        run = self._new_run()  # registered before anything is awaited: close() ends it from here on
        try:
            return await self._execute(run, command, timeout_s)
        finally:
            run.stop()
            run.close_lifeline_in()
            self._runs.discard(run)
            await self._end_disk(run)
            run.done.set()

    async def run_python(self, code: str, *, timeout_s: float, files: dict[str, bytes] | None = None) -> ExecResult:
        """Write ``files`` and run ``code`` in the persistent interpreter, whose globals persist between calls."""
        return await self._warm_call({"python": code}, timeout_s, files)

    async def read_file(self, path: str) -> bytes:
        """The file at ``path`` (relative to the workspace, or inside a mount), without following symlinks."""
        if self._closed:
            raise RuntimeError("this sandbox is closed")
        return await asyncio.to_thread(storage.read_file, self._ensure_workspace(), self._relative(path))

    async def close(self) -> None:
        """Kill whatever still runs, wait until it is gone, and remove the sandbox's directory (idempotent)."""
        self._closed = True
        runs = list(self._runs)
        for run in runs:
            run.stop()
        if runs:
            await asyncio.wait([asyncio.ensure_future(run.done.wait()) for run in runs], timeout=2 * DRAIN_GRACE_S)
        watch, self._disk_watch = self._disk_watch, None
        if watch is not None and watch.get_loop() is asyncio.get_running_loop():
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
        interpreter, self._interpreter = self._interpreter, None
        if interpreter is not None:
            await interpreter.stop()
        root, self._root = self._root, None
        if root is not None:
            await asyncio.to_thread(storage.remove_tree, root)

    # -- internals ------------------------------------------------------------------------------------

    @property
    def _owner(self) -> tuple[int, int] | None:
        """Who commands run as, when that is not us (Miles runs as root)."""
        return (NOBODY, NOBODY) if os.geteuid() == 0 else None

    @property
    def _disk_bytes(self) -> int:
        return self.disk_mb << 20

    def _ensure_workspace(self) -> str:
        """The workspace (``work`` in the sandbox's directory), made with the directory on first use."""
        if self._root is None:
            root = tempfile.mkdtemp(prefix="miles-sandbox-", dir=self.workspace_root)
            os.chmod(root, 0o711)  # commands (nobody) reach their folders in it, and make nothing beside them
            storage.make_folder(os.path.join(root, "work"), self._owner)
            for mount in self.mounts:
                storage.write_below(os.path.join(root, "work"), PurePosixPath(mount).parts[1:], None, self._owner)
            self._root, self._disk_used = root, storage.disk_use(root)
        return os.path.join(self._root, "work")

    def _new_run(self) -> processes.Run:
        """A run's state and its private folder (its temporary folders), registered; the disk watch runs while any
        run does."""
        assert self._root is not None
        self._runs_started += 1
        folder = os.path.join(self._root, f"run-{self._runs_started}")
        storage.make_folder(folder, self._owner)
        self._scratch(folder)
        self._disk_used += storage.BLOCK + storage.disk_use(folder)  # a few folders: the baseline holds them
        run = processes.Run(folder, baseline=self._disk_used, bwrap=self.isolation == "bwrap")
        self._watch(run)
        return run

    def _scratch(self, folder: str) -> tuple[str, str]:
        """The temporary folders in ``folder`` (of the sandbox's directory, so that the quota counts them), made when
        missing: ``tmp``, the ``/tmp`` of bwrap mode and the ``$TMPDIR`` of subprocess mode, and ``shm``, the
        ``/dev/shm`` of bwrap mode."""
        tmp, shm = os.path.join(folder, "tmp"), os.path.join(folder, "shm")
        if not os.path.isdir(tmp):
            storage.make_folder(tmp, self._owner)
            workspace = PurePosixPath(self._root, "work")  # type: ignore[arg-type]
            if self.isolation == "bwrap" and PurePosixPath("/tmp") in workspace.parents:
                # bwrap would make the workspace's mount point in /tmp: made now, it is in the baseline
                storage.write_below(tmp, workspace.relative_to("/tmp").parts, None, self._owner)
        if self.isolation == "bwrap" and not os.path.isdir(shm):
            storage.make_folder(shm, self._owner)
        return tmp, shm

    def _watch(self, run: processes.Run | WarmCall) -> None:
        """Register a run; the disk watch runs while any run does."""
        self._runs.add(run)
        watch = self._disk_watch
        if watch is None or watch.done() or watch.get_loop() is not asyncio.get_running_loop():
            self._disk_watch = asyncio.ensure_future(self._watch_disk())

    def _call_lock(self) -> asyncio.Lock:
        """The interpreter's calls' queue (a lock belongs to one event loop: Miles may run each step on its own)."""
        loop = asyncio.get_running_loop()
        if self._lock is None or self._lock[0] is not loop:
            self._lock = (loop, asyncio.Lock())
        return self._lock[1]

    def _before_call(self, timeout_s: float, files: dict[str, bytes] | None) -> None:
        """What every call checks and does first: the sandbox is open, the limit is a positive number of seconds,
        and ``files`` (paths relative to the workspace) are written."""
        if self._closed:
            raise RuntimeError("this sandbox is closed")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: expected a positive number of seconds, got {timeout_s!r}")
        self._put_files(self._ensure_workspace(), {self._relative(path): data.encode() if isinstance(data, str)
                                                   else data for path, data in (files or {}).items()})

    async def _warm_call(self, request: dict, timeout_s: float, files: dict[str, bytes] | None) -> ExecResult:
        """One call of the persistent interpreter, after those queued before it; the disk quota holds as for a run."""
        self._before_call(timeout_s, files)
        async with self._call_lock():
            started = time.monotonic()
            interpreter = await self._ensure_interpreter()
            call = WarmCall(interpreter, baseline=self._disk_used)
            self._watch(call)
            try:
                outcome = await interpreter.call(request, timeout_s, self.output_bytes)
                if self._root is not None:
                    used = self._disk_used = await asyncio.to_thread(storage.disk_use, self._root)
                    if used > max(self._disk_bytes, call.baseline) and call.over_quota is None:
                        call.over_quota = used
            finally:
                self._runs.discard(call)
                call.done.set()
            if call.stopped:  # the disk watch killed it, maybe after the reply came: it still looked alive
                await interpreter.stop()
            exit_code, stderr, ended = outcome.exit_code, outcome.stderr, outcome.ended
            if call.over_quota is not None:
                exit_code = None if outcome.timed_out else QUOTA_EXIT_CODE
                stderr += QUOTA_MARKER.format(used=storage.size_text(call.over_quota), limit=self.disk_mb)
                if call.stopped:
                    ended = "the call took the sandbox over its disk quota"
            if ended is not None or call.over_quota is not None:
                self.spoiled = self.spoiled or ended or "the disk quota"
            if ended is not None and not self._closed:
                stderr += RESTART_MARKER.format(reason=ended)
                try:
                    await self._ensure_interpreter()  # the next call finds it ready
                except Exception as exc:  # noqa: BLE001 - the next call tries again and raises
                    log.warning("the sandbox's interpreter did not restart: %s", exc)
            return ExecResult(outcome.stdout, stderr, exit_code, outcome.timed_out, time.monotonic() - started)

    async def _ensure_interpreter(self) -> Interpreter:
        """The persistent interpreter, started when there is none or it ended."""
        if self._interpreter is None or not self._interpreter.alive:
            self._interpreter = None
            interpreter = self._new_interpreter()
            await interpreter.start()
            if self._closed:  # close() came while it started
                await interpreter.stop()
                raise RuntimeError("this sandbox is closed")
            self._interpreter = interpreter
        return self._interpreter

    def _new_interpreter(self) -> Interpreter:
        """The persistent interpreter as :meth:`_spawn` starts a command, with the sandbox's ``tmp`` and ``shm``
        folders as its ``/tmp`` and ``/dev/shm`` (for its life), no CPU limit of its own (it gives each call
        ``cpu_s`` more) and the channel it is fed on."""
        assert self._root is not None
        workspace = os.path.join(self._root, "work")
        tmp, shm = self._scratch(self._root)
        limits = [limit for limit in self._rlimits if limit[0] != resource.RLIMIT_CPU]
        server = ["-I", "-c", server_source(), str(CHANNEL_FD), self.isolation, str(self._cpu_s), workspace]
        if self.isolation == "bwrap":
            bwrap = processes.bwrap_argv(workspace, tmp, shm, self.max_procs, self.mounts, self.cwd)
            argv = ["/bin/sh", "-c", WATCH_LIFELINE, "sh", *bwrap, "python3", *server]
            setup = processes.child_setup(os.getpid(), limits, signal.SIGKILL)
            options = processes.spawn_options(workspace, setup, tmp="/tmp", as_nobody=True)
        else:
            uid, gid = self._owner or (-1, -1)
            text = ",".join(f"{limit}:{soft}:{hard}" for limit, soft, hard in limits)
            argv = [sys.executable or "python3", "-I", "-S", REAPER, str(os.getpid()), str(uid), str(gid), text,
                    "/bin/sh", "-c", 'exec python3 "$@"', "python3", *server]  # python3 as a command finds it
            setup = processes.child_setup(os.getpid(), [], signal.SIGTERM, subreaper=True)
            options = processes.spawn_options(workspace, setup, tmp=tmp, as_nobody=False)
        for stream in ("stdin", "stdout", "stderr"):
            options.pop(stream)
        return Interpreter(argv, options, bwrap=self.isolation == "bwrap",
                           log_path=os.path.join(self._root, "interpreter.log"))

    def _put_files(self, workspace: str, files: dict[str, bytes]) -> None:
        """Write ``files`` in the workspace, refusing them all when they would not fit in the quota. The disk
        use is the last one measured (at the end of the last run, or while runs go on) and what we wrote since."""
        for path in files:
            storage.check_file_path(path)
        grown = sum(storage.charge(len(data)) - storage.charge_of(workspace, path) for path, data in files.items())
        if self._disk_used + grown > self._disk_bytes and grown > 0:
            raise ValueError(f"files: writing them would take the sandbox to "
                             f"{storage.size_text(self._disk_used + grown)}, more than its disk quota "
                             f"disk_mb={self.disk_mb}; raise disk_mb or write less")
        for path, data in files.items():
            storage.write_file(workspace, path, data, self._owner)
        self._disk_used += grown

    async def _execute(self, run: processes.Run, command: str, timeout_s: float) -> ExecResult:
        """Start the run's processes, wait for the command (at most ``timeout_s``), then end them all."""
        started = time.monotonic()
        transport, output = await self._spawn(run, command)
        if self._closed:  # close() came while the process was starting
            run.stop()
        timed_out = False
        try:
            try:
                await asyncio.wait_for(output.exited.wait(), timeout_s)
            except asyncio.TimeoutError:
                timed_out = True
            run.stop()  # background processes end with the run; their pipes close
            try:
                await asyncio.wait_for(output.closed.wait(), DRAIN_GRACE_S)
            except asyncio.TimeoutError:
                log.warning("a sandbox run's processes did not end within %.0f s of being killed", DRAIN_GRACE_S)
        finally:
            run.stop()
            transport.close()
        await self._end_disk(run)
        code = transport.get_returncode()
        exit_code = None if timed_out else (128 - code if code is not None and code < 0 else code)
        stderr = output.stderr.text()
        if run.over_quota is not None:
            exit_code = None if timed_out else QUOTA_EXIT_CODE
            stderr += QUOTA_MARKER.format(used=storage.size_text(run.over_quota), limit=self.disk_mb)
        if timed_out or run.over_quota is not None:
            self.spoiled = self.spoiled or ("a command timed out" if timed_out else "the disk quota")
        return ExecResult(output.stdout.text(), stderr, exit_code, timed_out, time.monotonic() - started)

    async def _spawn(self, run: processes.Run, command: str) -> tuple[asyncio.SubprocessTransport, processes.Output]:
        """Start ``command``: in bwrap mode behind the lifeline watcher, in subprocess mode under the reaper."""
        workspace = os.path.join(self._root, "work")  # type: ignore[arg-type]
        tmp, shm = self._scratch(run.folder)  # type: ignore[arg-type]
        if self.isolation == "bwrap":
            bwrap = processes.bwrap_argv(workspace, tmp, shm, self.max_procs, self.mounts, self.cwd)
            argv = ["/bin/sh", "-c", processes.WATCH_LIFELINE, "sh", *bwrap, "/bin/sh", "-c", command]
            setup = processes.child_setup(os.getpid(), self._rlimits, signal.SIGKILL)
            options = processes.spawn_options(workspace, setup, run.lifeline_in, tmp="/tmp", as_nobody=True)
        else:
            uid, gid = self._owner or (-1, -1)
            limits = ",".join(f"{limit}:{soft}:{hard}" for limit, soft, hard in self._rlimits)
            argv = [sys.executable or "python3", "-I", "-S", REAPER, str(os.getpid()), str(uid), str(gid), limits,
                    "/bin/sh", "-c", command]
            # SIGTERM: the reaper's cue to kill what the command started (SIGKILL would orphan it)
            setup = processes.child_setup(os.getpid(), [], signal.SIGTERM, subreaper=True)
            options = processes.spawn_options(workspace, setup, run.lifeline_in, tmp=tmp, as_nobody=False)
        try:
            transport, output = await asyncio.get_running_loop().subprocess_exec(
                lambda: processes.Output(self.output_bytes), *argv, **options)
        finally:
            run.close_lifeline_in()
        run.transport = transport
        return transport, output

    async def _watch_disk(self) -> None:
        """Measure the disk use every DISK_CHECK_S while commands run."""
        while self._runs:
            await asyncio.sleep(DISK_CHECK_S)
            await self._check_disk()

    async def _check_disk(self) -> None:
        """Stop the runs that took the sandbox over its quota: those running that found it below what it
        holds now."""
        if self._root is None:
            return
        # judged by this measurement: the runs it saw from its start to its end (not one that started meanwhile,
        # from a baseline measured later, nor one that ended: a warm call's interpreter serves the next)
        runs, kept = list(self._runs), self._disk_used
        used = await asyncio.to_thread(storage.disk_use, self._root)
        if self._disk_used == kept:  # else a measurement (or a write) since it started holds the newer figure
            self._disk_used = used
        for run in runs:
            if run in self._runs and used > max(self._disk_bytes, run.baseline) and run.over_quota is None:
                run.over_quota = used
                run.stop()

    async def _end_disk(self, run: processes.Run) -> None:
        """Once a run's processes are gone: measure the sandbox with the run's private folder (what it wrote in its
        temporary folders counts too), whether the run took it over the quota, then remove the folder (once)."""
        if self._root is None or run.folder is None:
            return
        folder, run.folder = run.folder, None
        used, self._disk_used = await asyncio.to_thread(storage.measure_and_remove, self._root, folder)
        if used > max(self._disk_bytes, run.baseline) and run.over_quota is None:
            run.over_quota = used

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
