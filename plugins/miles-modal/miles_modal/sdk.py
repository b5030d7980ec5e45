"""Every call Miles makes into Modal's SDK (``modal``, the version pinned in pyproject.toml), in one place.

Each call is the SDK's async variant (``.aio``) and none bounds its own time: the caller
(:class:`miles.agentic.RemoteSandbox`) does, because without a network the SDK's client keeps retrying for
about a minute before it gives up. Keeping these calls here keeps small the surface that the test suite's
stand-in replaces (``tests/standin_modal.py``): ``App.lookup``, ``Client.from_env`` (and ``hello``),
``Sandbox.create``, ``Sandbox.list``, ``Sandbox.from_id`` and, on a sandbox, ``exec`` (its ``stdout``,
``stderr`` and ``wait``), ``filesystem.write_bytes``, ``filesystem.read_bytes`` and ``terminate``.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import modal
import modal.config
import modal.exception

from miles.agentic import CUT_MARKER

__all__ = ["APP_NAME", "PERMANENT_ERRORS", "create", "exec_command", "list_ids", "missing_credentials",
           "probe", "read", "server_url", "terminate", "terminate_id", "write"]

APP_NAME = "miles-sandboxes"  # the Modal app every Miles sandbox belongs to (gc lists the sandboxes of this app)
EXEC_TIMED_OUT = -1  # the SDK's exit code for an exec that ran past its ``timeout``

# What retrying cannot fix: bad or missing credentials, a workspace without the right, an invalid request
# (a bad argument), an app or sandbox that is not there, an image that does not build.
PERMANENT_ERRORS: tuple[type[BaseException], ...] = (
    modal.exception.AuthError, modal.exception.PermissionDeniedError, modal.exception.InvalidError,
    modal.exception.NotFoundError, modal.exception.ImageBuildError)


def server_url() -> str:
    """The Modal server the SDK talks to (``MODAL_SERVER_URL``, or ``server_url`` in ``~/.modal.toml``; by
    default ``https://api.modal.com``, failing over to a second address), for messages."""
    return " or ".join(url.strip() for url in str(modal.config.config.get("server_url")).split(","))


def missing_credentials() -> list[str]:
    """The token variables the SDK's configuration lacks (it reads ``MODAL_TOKEN_ID`` and ``MODAL_TOKEN_SECRET``,
    then the active profile of ``~/.modal.toml``); [] also when OAuth credentials are configured."""
    config = modal.config.config
    if config.get("oauth_refresh_token"):
        return []
    return [name for key, name in (("token_id", "MODAL_TOKEN_ID"), ("token_secret", "MODAL_TOKEN_SECRET"))
            if not config.get(key)]


async def probe() -> None:
    """One authenticated round trip: the SDK's client, connected and greeted (``ClientHello``)."""
    client = await modal.Client.from_env.aio()
    await client.hello.aio()


async def create(*, image: str | None, tags: dict[str, str], lifetime_s: float, block_network: bool,
                 cpu: float | None, memory_mb: int | None) -> Any:
    """A new sandbox in Miles' app (made when missing), tagged, deleted by Modal after ``lifetime_s``."""
    app = await modal.App.lookup.aio(APP_NAME, create_if_missing=True)
    return await modal.Sandbox.create.aio(
        app=app, image=modal.Image.from_registry(image) if image else modal.Image.debian_slim(), tags=tags,
        timeout=math.ceil(lifetime_s), block_network=block_network, cpu=cpu, memory=memory_mb)


async def exec_command(sandbox: Any, command: str, *, cwd: str, timeout_s: float,
                       output_bytes: int) -> tuple[str, str, int | None, bool]:
    """Run ``command`` with ``/bin/sh -c`` in ``cwd``: stdout and stderr (each cut to ``output_bytes`` while it
    streams in), the exit code (None when it timed out) and whether it timed out. Modal kills the command
    after ``timeout_s`` (whole seconds, rounded up)."""
    process = await sandbox.exec.aio("/bin/sh", "-c", command, workdir=cwd, timeout=max(1, math.ceil(timeout_s)),
                                     text=False)
    stdout, stderr, code = await asyncio.gather(_read_capped(process.stdout, output_bytes),
                                                _read_capped(process.stderr, output_bytes), process.wait.aio())
    timed_out = code == EXEC_TIMED_OUT
    return stdout, stderr, None if timed_out else code, timed_out


async def write(sandbox: Any, path: str, data: bytes) -> None:
    """Write ``data`` at the absolute ``path`` (Modal makes the parent folders)."""
    await sandbox.filesystem.write_bytes.aio(data, path)


async def read(sandbox: Any, path: str) -> bytes:
    try:
        return await sandbox.filesystem.read_bytes.aio(path)
    except modal.exception.SandboxFilesystemNotFoundError as exc:
        raise FileNotFoundError(f"{path}: no such file in the sandbox ({exc})") from exc


async def terminate(sandbox: Any) -> None:
    await sandbox.terminate.aio()


async def list_ids(tags: dict[str, str]) -> list[str]:
    """Ids of the running sandboxes of Miles' app that carry all of ``tags`` (none when there is no such app)."""
    try:
        app = await modal.App.lookup.aio(APP_NAME)
    except modal.exception.NotFoundError:
        return []
    return [sandbox.object_id async for sandbox in modal.Sandbox.list.aio(app_id=app.app_id, tags=tags)]


async def terminate_id(sandbox_id: str) -> None:
    """Terminate the sandbox ``sandbox_id``; one that is gone already is fine."""
    try:
        sandbox = await modal.Sandbox.from_id.aio(sandbox_id)
        await sandbox.terminate.aio()
    except modal.exception.NotFoundError:
        pass


async def _read_capped(stream: Any, cap: int) -> str:
    """A stream's text, read to its end but holding at most ``cap`` bytes: a longer output keeps its start and
    ends with a marker counting the bytes cut, all of it within ``cap`` bytes."""
    kept, total = bytearray(), 0
    async for chunk in stream:
        total += len(chunk)
        kept += chunk[: max(0, cap - len(kept))]
    if total <= cap:
        return kept.decode(errors="replace")
    budget = max(0, cap - len(CUT_MARKER.format(total).encode()))  # the count shown is at most this long
    text = kept[:budget].decode(errors="replace").encode()[:budget].decode(errors="ignore")
    return text + CUT_MARKER.format(total - len(text.encode()))
