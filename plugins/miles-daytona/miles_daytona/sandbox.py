"""``DaytonaSandbox``: a Miles sandbox hosted by Daytona, on Daytona's official async SDK.

Miles' :class:`~miles.agentic.RemoteSandbox` does what every hosted sandbox shares (retries, the limit
on live sandboxes, tags, deleting on close, at the run's end and by ``gc``, capped outputs); this class
is the Daytona side of it:

- create: ``AsyncDaytona.create`` from a snapshot (Daytona's default unless ``snapshot`` names one) or
  an ``image``, labelled with Miles' tags, ephemeral (deleted as soon as it stops) with a time to live
  of ``lifetime_s`` (``ttl_minutes``), so that a sandbox a killed run leaves behind still goes away;
  network blocked unless ``network_block_all: false``;
- commands: one ``process/execute`` call each, through :mod:`miles_daytona.wrapper` (stdout and stderr
  apart, exit code, timeout, output cap);
- files: the toolbox's bulk upload and download;
- the working folder: the sandbox's own (the image's WORKDIR or its user's home, as Daytona reports it)
  unless ``workdir`` is given.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from daytona import AsyncDaytona, AsyncSandbox, CreateSandboxFromImageParams, CreateSandboxFromSnapshotParams
from daytona import DaytonaNotFoundError, DaytonaTimeoutError, ListSandboxesQuery

from miles.agentic import RemoteSandbox
from miles_daytona import client as clients
from miles_daytona.wrapper import parse_answer, script

__all__ = ["DaytonaSandbox"]

EXEC_GRACE_S = 10  # Daytona's own kill of a command comes this long after ours, should ours not work
REQUEST_TIMEOUT_S = 60  # the SDK's limit on a file transfer (Miles' base bounds each call more tightly)


@dataclass
class _Handle:
    """One live sandbox and the client it came from (kept until it is deleted)."""

    client: AsyncDaytona
    sandbox: AsyncSandbox


class DaytonaSandbox(RemoteSandbox):
    """A Daytona sandbox per trajectory; see the module docstring. Provider arguments: ``snapshot``
    (a Daytona snapshot's name; default: Daytona's default snapshot), ``image`` (a container image such
    as ``python:3.12-slim``, which Daytona builds into a snapshot on first use; not with ``snapshot``),
    ``target`` (the region; default ``DAYTONA_TARGET`` or the organization's), ``network_block_all``
    (default true: commands reach no network, as in Miles' local sandbox) and ``env_vars`` (environment
    of the sandbox). The common arguments are :class:`~miles.agentic.RemoteSandbox`'s; ``run_id`` is named
    here because Miles' runner passes the run's id only to a factory whose signature shows it."""

    provider: ClassVar[str] = "daytona"
    credentials: ClassVar[tuple[str, ...]] = ("DAYTONA_API_KEY",)
    default_workdir: ClassVar[str] = "/home/daytona"  # Daytona's default; a sandbox's own replaces it on create
    service_url_env: ClassVar[str | None] = clients.API_URL_ENV

    def __init__(self, *, snapshot: str | None = None, image: str | None = None, target: str | None = None,
                 network_block_all: bool = True, env_vars: dict[str, str] | None = None, run_id: str | None = None,
                 **common: Any) -> None:
        self.check_provider_args({"snapshot": snapshot, "image": image, "target": target,
                                  "network_block_all": network_block_all, "env_vars": env_vars})
        super().__init__(run_id=run_id, **common)
        self.snapshot, self.image, self.target = snapshot, image, target
        self.network_block_all, self.env_vars = network_block_all, dict(env_vars or {})
        self._own_workdir = common.get("workdir") is None  # take the sandbox's working folder once it exists
        self._own_cwd = common.get("cwd") is None

    @classmethod
    def check_args(cls, args: dict[str, Any]) -> None:
        """Config validation: credentials, every argument known and in range (ValueError names which)."""
        accepted = [name for name in dict.fromkeys([*inspect.signature(cls.__init__).parameters,
                                                    *inspect.signature(RemoteSandbox.__init__).parameters])
                    if name not in ("self", "common")]
        for name in args:
            if name not in accepted:
                raise ValueError(f"{name}: the daytona sandbox takes no argument {name!r}; it accepts: "
                                 f"{', '.join(accepted)}")
        super().check_args(args)
        cls.check_provider_args(args)

    @staticmethod
    def check_provider_args(args: dict[str, Any]) -> None:
        """The Daytona arguments' checks, shared by the constructor and config validation."""
        for name in ("snapshot", "image", "target"):
            if args.get(name) is not None and not (isinstance(args[name], str) and args[name]):
                raise ValueError(f"{name}: expected a non-empty string or null, got {args[name]!r}")
        if args.get("snapshot") and args.get("image"):
            raise ValueError(f"snapshot and image: give one of them (a sandbox starts from a snapshot or is built "
                             f"from an image), got both: {args['snapshot']!r}, {args['image']!r}")
        if not isinstance(args.get("network_block_all", True), bool):
            raise ValueError(f"network_block_all: expected true or false, got {args['network_block_all']!r}")
        env_vars = args.get("env_vars") or {}
        if not (isinstance(env_vars, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in env_vars.items())):
            raise ValueError(f"env_vars: expected a mapping of names to strings, got {env_vars!r}")

    @classmethod
    def describe(cls, **config: Any) -> str:
        source = (f"image {config['image']}" if config.get("image")
                  else f"snapshot {config.get('snapshot') or '(Daytona default)'}")
        network = "no network" if config.get("network_block_all", True) else "network open"
        return (f"daytona sandboxes at {clients.api_url()} ({source}, {network}), at most "
                f"{config.get('max_concurrent', 16)} at once, deleted at the end of each trajectory and of the run")

    @classmethod
    async def gc(cls, run_id: str | None = None) -> list[str]:
        """Delete the leftovers of run ``run_id`` (None: of any Miles run), with one client for them all."""
        async with clients.borrowed():
            return await super().gc(run_id)

    # -- provider hooks ------------------------------------------------------------------------------

    async def _create(self, labels: dict[str, str], lifetime_s: float) -> _Handle:
        minutes = max(1, math.ceil(lifetime_s / 60))
        common = dict(labels=dict(labels), env_vars=self.env_vars, target=self.target, ephemeral=True,
                      ttl_minutes=minutes, auto_stop_interval=minutes, network_block_all=self.network_block_all)
        params = (CreateSandboxFromImageParams(image=self.image, **common) if self.image
                  else CreateSandboxFromSnapshotParams(snapshot=self.snapshot, **common))
        client = clients.acquire()
        try:
            with clients.sdk_errors():
                sandbox = await client.create(params, timeout=self.create_timeout_s)
            handle = _Handle(client, sandbox)
            if self._own_workdir:
                with clients.sdk_errors():
                    self.workdir = await sandbox.get_work_dir()
                if self._own_cwd:
                    self.cwd = self.workdir
            return handle
        except BaseException:
            await clients.release(client)  # a sandbox made before the failure is found by its labels and deleted
            raise

    async def _exec(self, handle: _Handle, command: str, *, cwd: str,
                    timeout_s: float) -> tuple[str, str, int | None, bool]:
        text, marker = script(command, timeout_s=timeout_s, output_bytes=self.output_bytes)
        with clients.sdk_errors():
            try:
                limit = math.ceil(timeout_s) + EXEC_GRACE_S
                response = await handle.sandbox.process.exec(text, cwd=cwd, timeout=limit)
            except DaytonaTimeoutError as exc:
                if exc.status_code != 408:  # the request timed out here, not the command there
                    raise
                return "", "", None, True  # Daytona killed the command: our own limit did not
        return parse_answer(response.result or "", marker, self.output_bytes)

    async def _write(self, handle: _Handle, path: str, data: bytes) -> None:
        with clients.sdk_errors():
            await handle.sandbox.fs.upload_file(data, path, timeout=REQUEST_TIMEOUT_S)

    async def _read(self, handle: _Handle, path: str) -> bytes:
        with clients.sdk_errors():
            try:
                return await handle.sandbox.fs.download_file(path, REQUEST_TIMEOUT_S)
            except DaytonaNotFoundError as exc:
                raise FileNotFoundError(f"{path}: no such file in the daytona sandbox") from exc

    async def _delete(self, handle: _Handle) -> None:
        try:
            with clients.sdk_errors(), contextlib.suppress(DaytonaNotFoundError):  # gone already: its time ran out
                await handle.sandbox.delete()
        finally:
            await clients.release(handle.client)

    @classmethod
    async def _list(cls, labels: dict[str, str]) -> list[str]:
        async with clients.borrowed() as client:
            return [sandbox.id async for sandbox in client.list(ListSandboxesQuery(labels=labels))]

    @classmethod
    async def _delete_id(cls, sandbox_id: str) -> None:
        async with clients.borrowed() as client:
            with contextlib.suppress(DaytonaNotFoundError):
                await (await client.get(sandbox_id)).delete()

    @classmethod
    async def _probe(cls) -> None:
        async with clients.borrowed() as client:
            async with contextlib.aclosing(client.list(ListSandboxesQuery(limit=1))) as sandboxes:
                async for _ in sandboxes:
                    break
