"""What every hosted sandbox (E2B, Modal, Daytona ...) needs besides its provider's calls.

A provider plugin subclasses :class:`RemoteSandbox` and implements a handful of hooks (create, exec,
write, read, delete, list and delete by id, probe). The base makes the rest the same for all of them:

- a sandbox per trajectory, created on first use, with retries and exponential backoff for transient
  errors (:class:`PermanentError` is not retried) and a time limit on every call to the provider;
- a limit on live sandboxes per provider in this process (``max_concurrent``; the next one waits);
- outputs capped like the local sandbox's, a working folder made on create, ``mounts`` made as folders;
- every sandbox tagged ``miles=1`` and ``miles-run=<run id>`` and given a provider-side lifetime, recorded
  from the moment its create is sent until it is deleted, and deleted on close, when its creation fails half
  way, and by :meth:`close_all` (the run's end, a failure, Ctrl-C); :meth:`gc` deletes what a killed run left
  behind, found by its tags.

A create cut short before its answer came (Ctrl-C, a trajectory's time limit) may still have made a sandbox:
it is deleted by its tags. A delete that fails or is cut short (a second Ctrl-C, the event loop shutting down)
leaves the sandbox recorded, so that a later close or :meth:`close_all`, on any event loop, tries again;
``close_all(run_id=...)`` also ends the run: no sandbox of it is created afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import time
import uuid
import weakref
from typing import Any, ClassVar

from miles.agentic.types import CUT_MARKER, ExecResult

__all__ = ["PermanentError", "RemoteSandbox", "RUN_ID_ENV"]

RUN_ID_ENV = "MILES_RUN_ID"  # the run id tags default to, when the runner did not pass one
CALL_GRACE_S = 30.0  # how much longer than a command's own timeout its provider call may take
CONNECT_TIMEOUT_S = 10.0  # gc's and the default preflight's limit per call


class PermanentError(Exception):
    """A provider error that retrying cannot fix (bad credentials, an unknown template or image)."""


class RemoteSandbox:
    """A sandbox hosted by a provider; see the module docstring. Subclasses set the class attributes and
    implement the ``_`` hooks; Miles calls ``Cls(**config)`` once per trajectory.

    Common arguments: ``run_id`` (tags; the runner passes the run's), ``workdir`` (where relative paths
    and commands start), ``create_retries`` and ``backoff_s`` (retries of a failed create, the wait
    doubling from ``backoff_s``), ``create_timeout_s`` (per create attempt), ``connect_timeout_s`` (the
    start-up probe and every file or delete call), ``max_concurrent`` (live sandboxes of this provider in
    this process), ``lifetime_s`` (the provider deletes the sandbox after this long whatever happens
    here), ``output_bytes`` (the cap of stdout and stderr each), ``mounts`` (absolute folders to make),
    ``cwd`` (where commands start, default ``workdir``).
    """

    provider: ClassVar[str] = ""
    credentials: ClassVar[tuple[str, ...]] = ()  # environment variables the provider's SDK needs
    default_workdir: ClassVar[str] = "/tmp/miles-work"
    service_url_env: ClassVar[str | None] = None  # the SDK's variable for the service's address, for messages

    _live: ClassVar[dict[str, RemoteSandbox]]  # per subclass: id(self) -> sandbox, while it may exist
    _slots: ClassVar[weakref.WeakKeyDictionary]  # per subclass and event loop: a Semaphore
    _ended_runs: ClassVar[set[str]]  # per subclass: runs whose close_all began; none of their sandboxes opens

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._live, cls._slots, cls._ended_runs = {}, weakref.WeakKeyDictionary(), set()

    def __init__(self, *, run_id: str | None = None, workdir: str | None = None, create_retries: int = 3,
                 backoff_s: float = 1.0, create_timeout_s: float = 120.0, connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 max_concurrent: int = 16, lifetime_s: float = 3600.0, output_bytes: int = 65536,
                 mounts: list[str] | tuple[str, ...] = (), cwd: str | None = None) -> None:
        self.check_common({"create_retries": create_retries, "backoff_s": backoff_s,
                           "create_timeout_s": create_timeout_s, "connect_timeout_s": connect_timeout_s,
                           "max_concurrent": max_concurrent, "lifetime_s": lifetime_s, "output_bytes": output_bytes,
                           "workdir": workdir, "mounts": mounts, "cwd": cwd})
        self.run_id = run_id or os.environ.get(RUN_ID_ENV) or "adhoc"
        self.workdir = workdir or self.default_workdir
        self.create_retries, self.backoff_s = create_retries, backoff_s
        self.create_timeout_s, self.connect_timeout_s = create_timeout_s, connect_timeout_s
        self.max_concurrent, self.lifetime_s, self.output_bytes = max_concurrent, lifetime_s, output_bytes
        self.mounts, self.cwd = tuple(mounts), cwd or self.workdir
        self._handle: Any = None  # the provider's sandbox, from its create's answer until it is deleted
        self._labels: dict[str, str] | None = None  # its tags, from the moment its create is sent
        self._opening: asyncio.Task | None = None
        self._releasing: asyncio.Task | None = None  # the delete under way
        self._slot: asyncio.Semaphore | None = None  # the slot it holds, while it holds one
        self._closed = False

    # -- what Miles calls ----------------------------------------------------------------------------

    async def run(self, command: str, *, timeout_s: float, files: dict[str, bytes] | None = None) -> ExecResult:
        """Write ``files`` (relative to ``workdir``, or absolute) and run ``command`` in ``cwd``."""
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: expected a positive number of seconds, got {timeout_s!r}")
        handle = await self._open()
        for path, data in (files or {}).items():
            await self._call("write", self._write(handle, self._path(path),
                                                  data.encode() if isinstance(data, str) else data))
        started = time.monotonic()
        stdout, stderr, exit_code, timed_out = await self._call(
            "exec", self._exec(handle, command, cwd=self.cwd, timeout_s=timeout_s), timeout_s + CALL_GRACE_S)
        return ExecResult(self._cap(stdout), self._cap(stderr), None if timed_out else exit_code, bool(timed_out),
                          time.monotonic() - started)

    async def read_file(self, path: str) -> bytes:
        """The file at ``path`` (relative to ``workdir``, or absolute)."""
        return await self._call("read", self._read(await self._open(), self._path(path)))

    async def close(self) -> None:
        """Delete the sandbox (idempotent; a creation still under way is cancelled and cleaned up). Should
        the delete fail or be cut short, the sandbox stays recorded and the next close or close_all retries."""
        self._closed = True
        opening, self._opening = self._opening, None
        if opening is not None and not opening.done() and opening.get_loop() is asyncio.get_running_loop():
            opening.cancel()
            await asyncio.wait({opening})  # its clean-up is not cancelled again should this close be
        await self._release()

    @classmethod
    async def close_all(cls, run_id: str | None = None) -> int:
        """Delete every sandbox of this provider open in this process or being created, of run ``run_id``
        only when given; how many there were. With ``run_id`` the run is over: a sandbox of it that is not
        open yet never opens (its first use raises), so none is created after this began, whatever its
        trajectories still do. A RuntimeError names the sandboxes that could not be deleted (all are tried)."""
        if run_id is not None:
            cls._ended_runs.add(run_id)
        live = [sandbox for sandbox in cls._live.values() if run_id is None or sandbox.run_id == run_id]
        results = await asyncio.gather(*(sandbox.close() for sandbox in live), return_exceptions=True)
        left = [sandbox for sandbox in live if str(id(sandbox)) in cls._live]
        if left:
            errors = [f"{type(r).__name__}: {r}" if str(r) else type(r).__name__
                      for r in results if isinstance(r, BaseException)]
            runs = ", ".join(sorted({sandbox.run_id for sandbox in left}))
            raise RuntimeError(f"{cls.provider}: could not delete {len(left)} of {len(live)} sandboxes "
                               f"({'; '.join(dict.fromkeys(errors)) or 'no error'}); `miles sandbox gc` finds "
                               f"them by their tag miles-run={runs}")
        return len(live)

    @classmethod
    async def gc(cls, run_id: str | None = None) -> list[str]:
        """Delete the provider's sandboxes tagged by run ``run_id`` (None: by any Miles run); their ids."""
        return await cls._delete_labelled({"miles": "1", **({"miles-run": run_id} if run_id else {})},
                                          CONNECT_TIMEOUT_S)

    @classmethod
    async def _delete_labelled(cls, labels: dict[str, str], timeout_s: float) -> list[str]:
        """Delete the provider's sandboxes carrying all of ``labels``, each call within ``timeout_s``; their ids."""
        ids = await cls._bounded(cls._list(labels), timeout_s, "list sandboxes")
        for sandbox_id in ids:
            await cls._bounded(cls._delete_id(sandbox_id), timeout_s, f"delete sandbox {sandbox_id}")
        return ids

    @classmethod
    async def preflight(cls, **config: Any) -> None:
        """Reach the service once within ``connect_timeout_s`` (the run's start calls it)."""
        timeout_s = float(config.get("connect_timeout_s", CONNECT_TIMEOUT_S))
        await cls._bounded(cls._probe(), timeout_s, "reach the service")

    @classmethod
    def check_args(cls, args: dict[str, Any]) -> None:
        """Config validation: credentials present, common arguments in range (ValueError names which)."""
        missing = [name for name in cls.credentials if not os.environ.get(name)]
        if missing:
            raise ValueError(f"the {cls.provider} sandbox needs the environment variable{'s' * (len(missing) > 1)} "
                             f"{', '.join(missing)} (the {cls.provider} SDK's credentials); it is not set")
        cls.check_common(args)

    @classmethod
    def describe(cls, **config: Any) -> str:
        where = os.environ.get(cls.service_url_env or "", "") or "its default service"
        return (f"{cls.provider} sandboxes at {where}, at most {config.get('max_concurrent', 16)} at once, "
                f"deleted at the end of each trajectory and of the run")

    @staticmethod
    def check_common(args: dict[str, Any]) -> None:
        for name in ("create_retries",):
            if name in args and (isinstance(args[name], bool) or not isinstance(args[name], int) or args[name] < 0):
                raise ValueError(f"{name}: expected an integer >= 0, got {args[name]!r}")
        for name in ("max_concurrent", "output_bytes"):
            if name in args and (isinstance(args[name], bool) or not isinstance(args[name], int) or args[name] < 1):
                raise ValueError(f"{name}: expected a positive integer, got {args[name]!r}")
        for name in ("backoff_s", "create_timeout_s", "connect_timeout_s", "lifetime_s"):
            if name in args and not (isinstance(args[name], (int, float)) and args[name] > 0):
                raise ValueError(f"{name}: expected a positive number of seconds, got {args[name]!r}")
        for name in ("workdir", "cwd"):
            if args.get(name) is not None and not str(args[name]).startswith("/"):
                raise ValueError(f"{name}: expected an absolute path, got {args[name]!r}")
        mounts = args.get("mounts") or ()
        if isinstance(mounts, str) or not all(isinstance(m, str) and m.startswith("/") for m in mounts):
            raise ValueError(f"mounts: expected a list of absolute paths, got {mounts!r}")

    # -- provider hooks ------------------------------------------------------------------------------

    async def _create(self, labels: dict[str, str], lifetime_s: float) -> Any:
        """Make one sandbox tagged with ``labels``, deleted by the provider after ``lifetime_s``; a handle."""
        raise NotImplementedError

    async def _exec(self, handle: Any, command: str, *, cwd: str,
                    timeout_s: float) -> tuple[str, str, int | None, bool]:
        """Run ``command`` with a shell in ``cwd``: stdout, stderr, exit code (None if killed), timed out."""
        raise NotImplementedError

    async def _write(self, handle: Any, path: str, data: bytes) -> None:
        """Write ``data`` at the absolute ``path``, making its folders."""
        raise NotImplementedError

    async def _read(self, handle: Any, path: str) -> bytes:
        raise NotImplementedError

    async def _delete(self, handle: Any) -> None:
        raise NotImplementedError

    @classmethod
    async def _list(cls, labels: dict[str, str]) -> list[str]:
        """Ids of this account's sandboxes that carry all of ``labels``."""
        raise NotImplementedError

    @classmethod
    async def _delete_id(cls, sandbox_id: str) -> None:
        raise NotImplementedError

    @classmethod
    async def _probe(cls) -> None:
        """One cheap authenticated request; raise naming the host when it cannot be reached."""
        raise NotImplementedError

    # -- internals -----------------------------------------------------------------------------------

    async def _open(self) -> Any:
        if self._closed:
            raise RuntimeError(f"this {self.provider} sandbox is closed")
        if self._opening is None:
            self._check_run()
            self._opening = asyncio.ensure_future(self._create_with_retries())
        return await asyncio.shield(self._opening)  # the handle, once created (a failed create raises again)

    def _check_run(self) -> None:
        if self.run_id in type(self)._ended_runs:
            raise RuntimeError(f"run {self.run_id} is closing: its {self.provider} sandboxes were deleted "
                               f"and no new one is created")

    async def _create_with_retries(self) -> Any:
        loop = asyncio.get_running_loop()
        slot = type(self)._slots.setdefault(loop, asyncio.Semaphore(self.max_concurrent))
        await slot.acquire()
        self._slot = slot
        try:
            self._check_run()  # the run may have ended while this waited for a slot
        except RuntimeError:
            self._free_slot()
            raise
        # From here on (no await in between) the sandbox may exist: recorded with its tags, so that _release
        # deletes it by them should its create be cut short, and gives the slot back.
        labels = {"miles": "1", "miles-run": self.run_id, "miles-sandbox": uuid.uuid4().hex[:12]}
        self._labels = labels
        type(self)._live[str(id(self))] = self
        errors: list[str] = []
        try:
            for attempt in range(self.create_retries + 1):
                if attempt:
                    await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
                try:
                    self._handle = await self._bounded(self._create(labels, self.lifetime_s), self.create_timeout_s,
                                                       "create a sandbox")
                except PermanentError as exc:
                    errors.append(str(exc))
                    break
                except Exception as exc:
                    errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                folders = sorted({self.workdir, self.cwd, *self.mounts})
                _, stderr, code, _ = await self._call("exec", self._exec(
                    self._handle, "mkdir -p " + " ".join(map(shlex.quote, folders)), cwd="/",
                    timeout_s=self.connect_timeout_s))
                if code != 0:
                    raise RuntimeError(f"{self.provider}: cannot make the folders {folders} in the new sandbox "
                                       f"(exit code {code}): {stderr.strip()}")
                return self._handle
        except asyncio.CancelledError:
            # Cut short (a close, Ctrl-C, a time limit), maybe after the provider made the sandbox: delete it by
            # its handle, or by its tags when the answer never came. Should that fail or be cut short too, the
            # sandbox stays recorded: the close that cancelled this, or close_all, tries again.
            with contextlib.suppress(Exception):
                await self._release()
            raise
        except BaseException:
            await self._give_up()  # e.g. the folders could not be made: the sandbox is deleted, the error raised
            raise
        await self._give_up()  # an attempt that timed out here may have finished there
        raise RuntimeError(f"{self.provider}: could not create a sandbox in {len(errors)} attempt(s): "
                           + "; ".join(dict.fromkeys(errors)))

    async def _give_up(self) -> None:
        """After a failed create: delete what it may have made, best effort (the create's error is the one to
        report, and when the service cannot be reached now, ``gc`` finds the leftovers by their tags)."""
        try:
            await self._release()
        except Exception:
            self._handle = self._labels = None
            type(self)._live.pop(str(id(self)), None)

    async def _release(self) -> None:
        """Delete the sandbox if one may exist and give its slot back. A delete under way (another close's)
        is waited for, and redone should it have failed; the deleting runs in a task of its own, which a
        cancelled caller does not stop."""
        loop = asyncio.get_running_loop()
        while True:
            releasing = self._releasing
            if releasing is not None and not releasing.done() and releasing.get_loop() is loop:
                await asyncio.wait({releasing})
                continue
            if str(id(self)) not in type(self)._live:
                return  # deleted, or never created
            self._releasing = releasing = asyncio.ensure_future(self._delete_recorded())
            return await asyncio.shield(releasing)

    async def _delete_recorded(self) -> None:
        """Delete the recorded sandbox: by its handle, or by its tags when its create's answer never came.
        Only once that succeeded is it forgotten; its slot is given back whatever happens."""
        try:
            if self._handle is not None:
                await self._bounded(self._delete(self._handle), self.connect_timeout_s, "delete the sandbox")
            elif self._labels is not None:
                await self._delete_labelled(self._labels, self.connect_timeout_s)
        finally:
            self._free_slot()
        self._handle = self._labels = None
        type(self)._live.pop(str(id(self)), None)

    def _free_slot(self) -> None:
        slot, self._slot = self._slot, None
        if slot is not None:
            slot.release()

    async def _call(self, what: str, call: Any, timeout_s: float | None = None) -> Any:
        return await self._bounded(call, timeout_s or self.connect_timeout_s, what)

    @classmethod
    async def _bounded(cls, call: Any, timeout_s: float, what: str) -> Any:
        try:
            return await asyncio.wait_for(call, timeout_s)
        except asyncio.TimeoutError:
            url = os.environ.get(cls.service_url_env or "", "")
            where = f"{url}, from {cls.service_url_env}" if url else f"the {cls.provider} service"
            raise TimeoutError(f"{cls.provider}: could not {what} within {timeout_s:g} s ({where})") from None

    def _path(self, path: str) -> str:
        return path if path.startswith("/") else f"{self.workdir.rstrip('/')}/{path}"

    def _cap(self, text: str) -> str:
        data = (text or "").encode()
        if len(data) <= self.output_bytes:
            return text or ""
        return data[: self.output_bytes].decode(errors="replace") + CUT_MARKER.format(len(data) - self.output_bytes)
