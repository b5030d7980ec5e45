"""A Miles sandbox in another process (:mod:`miles_harbor.sandbox_host`), with the sandbox protocol:
``run(command, *, timeout_s, files=None)``, ``read_file(path)``, ``close()``.

For Harbor's side, which may run on a Python without Miles: the host runs on ``python`` (one with Miles
installed); this package's folder goes first on its ``PYTHONPATH``, so both sides run the same code.
Stdlib only.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["RunResult", "SandboxClient", "SandboxHostError"]

STREAM_LIMIT = 1 << 30
CLOSE_GRACE_S = 60.0
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])


class SandboxHostError(RuntimeError):
    """The sandbox host could not start, died, or failed a request (the message is the host's)."""


@dataclass
class RunResult:
    """What a run returned: Miles' ``ExecResult`` fields."""

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    duration_s: float


class SandboxClient:
    """One sandbox, served by a host process that this client starts (:meth:`start`) and ends
    (:meth:`close`, or when this process exits: the host ends with its stdin). Requests go one at a time."""

    def __init__(self, process: asyncio.subprocess.Process, stderr: Any) -> None:
        self._process, self._stderr = process, stderr
        self._lock = asyncio.Lock()

    @classmethod
    async def start(cls, python: str, options: dict[str, Any], *, timeout_s: float = 120.0) -> "SandboxClient":
        """Start a host on ``python`` with sandbox ``options`` and wait (up to ``timeout_s``) until it is ready."""
        path = os.pathsep.join(filter(None, [_PACKAGE_ROOT, os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path}
        stderr = tempfile.TemporaryFile()
        try:
            process = await asyncio.create_subprocess_exec(
                python, "-m", "miles_harbor.sandbox_host", stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=stderr, env=env, limit=STREAM_LIMIT)
        except OSError as exc:
            stderr.close()
            raise SandboxHostError(f"cannot start the Miles sandbox host with {python!r}: {exc}") from None
        client = cls(process, stderr)
        try:
            await asyncio.wait_for(client._request(options), timeout_s)
        except BaseException as exc:
            await client.close()
            if isinstance(exc, asyncio.TimeoutError):
                raise SandboxHostError(f"the Miles sandbox host ({python}) was not ready within {timeout_s:g} s "
                                       f"(start_timeout_sec)") from None
            raise
        return client

    async def run(self, command: str, *, timeout_s: float, files: dict[str, bytes] | None = None) -> RunResult:
        answer = await self._request({"op": "run", "command": command, "timeout_s": timeout_s, "files": {
            path: base64.b64encode(data).decode() for path, data in (files or {}).items()}})
        return RunResult(answer["stdout"], answer["stderr"], answer["exit_code"], answer["timed_out"],
                         answer["duration_s"])

    async def read_file(self, path: str) -> bytes:
        """The file at ``path`` (inside a mount, or relative to the workspace); FileNotFoundError if none."""
        return base64.b64decode((await self._request({"op": "read", "path": path}))["data"])

    async def close(self) -> None:
        """End the host: it closes the sandbox (killing what runs) and exits (idempotent)."""
        if not self._process.stdin.is_closing():
            self._process.stdin.close()
        try:
            await asyncio.wait_for(self._process.wait(), CLOSE_GRACE_S)
        except asyncio.TimeoutError:  # a safety net: the host closes its sandbox at once on end of input
            self._process.kill()
            await self._process.wait()
        self._stderr.close()

    async def _request(self, request: dict[str, Any]) -> dict[str, Any]:
        async with self._lock:
            if self._process.returncode is not None or self._process.stdin.is_closing():
                raise SandboxHostError("the Miles sandbox host is closed")
            self._process.stdin.write(json.dumps(request).encode() + b"\n")
            await self._process.stdin.drain()
            line = await self._process.stdout.readline()
        if not line:
            raise SandboxHostError(f"the Miles sandbox host exited (code {await self._process.wait()}): "
                                   f"{self._host_stderr()}")
        answer = json.loads(line)
        if "error" in answer:
            if answer.get("type") == "FileNotFoundError":
                raise FileNotFoundError(answer["error"])
            raise SandboxHostError(f"{answer['type']}: {answer['error']}")
        return answer

    def _host_stderr(self) -> str:
        self._stderr.seek(0)
        text = self._stderr.read().decode(errors="replace").strip()
        return text[-2000:] or "(no output on stderr)"
