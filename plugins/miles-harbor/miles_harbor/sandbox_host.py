"""Serves one Miles sandbox to another process over stdin and stdout, one JSON object a line.

Harbor runs on Python >= 3.12 in a venv of its own, where Miles (and torch) need not be installed; its
environment (:mod:`miles_harbor.harbor_environment`) starts ``python -m miles_harbor.sandbox_host`` with
a Python that has Miles, through :class:`miles_harbor.sandbox_client.SandboxClient`.

The first line is the options of Miles' local sandbox (``LocalSandbox(**options)``); the host answers
``{"ready": true}``, or ``{"error": ...}`` and exits. Then, one answer per request, in order:

- ``{"op": "run", "command": str, "timeout_s": float, "files": {path: base64}}`` ->
  ``{"stdout", "stderr", "exit_code", "timed_out", "duration_s"}``;
- ``{"op": "read", "path": str}`` -> ``{"data": base64}``;
- a request that fails -> ``{"error": "<message>", "type": "<exception type>"}``.

Requests run as they come (the client sends one at a time, so answers come in order). The end of stdin
closes the sandbox at once (kills what runs, removes the workspace) and ends the host.
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys
from typing import Any

from miles.agentic import LocalSandbox

STREAM_LIMIT = 1 << 30  # a line may carry files, base64-encoded


async def serve(reader: asyncio.StreamReader, write: Any) -> None:
    """Answer requests from ``reader`` with ``write(dict)`` until end of input."""
    try:
        sandbox = LocalSandbox(**json.loads(await reader.readline()))
    except Exception as exc:
        write({"error": str(exc), "type": type(exc).__name__})
        return
    write({"ready": True})
    running: set[asyncio.Task] = set()

    async def answer(request: dict[str, Any]) -> None:
        try:
            write(await _answer(sandbox, request))
        except Exception as exc:
            write({"error": str(exc), "type": type(exc).__name__})

    while line := await reader.readline():  # read on while a request runs, to see the end of input at once
        task = asyncio.create_task(answer(json.loads(line)))
        running.add(task)
        task.add_done_callback(running.discard)
    await sandbox.close()  # ends what still runs: those requests answer, then the host exits
    await asyncio.gather(*running)


async def _answer(sandbox: LocalSandbox, request: dict[str, Any]) -> dict[str, Any]:
    if request["op"] == "run":
        files = {path: base64.b64decode(data) for path, data in (request.get("files") or {}).items()}
        result = await sandbox.run(request["command"], timeout_s=float(request["timeout_s"]), files=files)
        return {"stdout": result.stdout, "stderr": result.stderr, "exit_code": result.exit_code,
                "timed_out": result.timed_out, "duration_s": result.duration_s}
    if request["op"] == "read":
        return {"data": base64.b64encode(await sandbox.read_file(request["path"])).decode()}
    raise ValueError(f"unknown op {request['op']!r} (expected run or read)")


async def main() -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=STREAM_LIMIT)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    def write(answer: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()

    await serve(reader, write)


if __name__ == "__main__":
    asyncio.run(main())
