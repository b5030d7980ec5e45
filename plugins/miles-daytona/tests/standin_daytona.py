"""A STAND-IN for the Daytona service, for tests: Daytona's cloud cannot be reached from here.

It serves, on 127.0.0.1 and a free port, the part of Daytona's two HTTP APIs that the pinned SDK
(``daytona==0.226.1``) calls for Miles, with the paths, JSON shapes and auth header that SDK speaks, so
that the SDK's real code runs (serialization, its models' validation, polling, multipart transfers):

- the main API at ``<url>/api`` (``DAYTONA_API_URL``): create a sandbox (answered in state ``creating``;
  the SDK polls until it reads ``started``), get, list by labels, delete;
- the toolbox API at the ``toolboxProxyUrl`` each sandbox carries (``<url>/toolbox/<id>/...``): the
  working folder, ``process/execute`` (the command's text run by a shell, stdout and stderr mixed in
  ``result``, HTTP 408 at its timeout, as Daytona's daemon answers), bulk upload and bulk download.

Each sandbox is a Miles ``local`` sandbox (bubblewrap) whose folder ``/daytona`` is its working folder
and kept between commands; a command's text goes to ``/bin/sh -c`` where Daytona's daemon feeds it to
the sandbox's shell on stdin. Not served: Daytona's event socket (``/api/socket.io``; the SDK falls back
to polling) and everything Miles does not use. Commands run on this machine, so the network and
filesystem isolation a real Daytona sandbox has cannot be shown here.

Tests steer it: ``fail_creates`` (answer the next N creates with ``fail_status``), ``fail_exec``
(answer commands with 500), ``hold_creates``/``hold_execs`` (requests wait, already counted, until
released), and read what it saw: ``creates``, ``create_bodies``, ``commands``, ``sandboxes`` (live),
``peak_live``, ``deleted``.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import threading
import time
import uuid
from collections.abc import Callable
from http import HTTPStatus
from typing import Any
from urllib.parse import quote

from aiohttp import web

from miles.agentic.sandboxes.local import LocalSandbox

API_KEY = "standin-key"
ROOT = "/daytona"  # each sandbox's working folder (a top-level folder this machine does not have)
BOUNDARY = "DAYTONA-FILE-BOUNDARY"


class DaytonaStandIn:
    """The stand-in service; ``start()`` it, point ``DAYTONA_API_URL`` at ``api_url``, ``stop()`` it."""

    def __init__(self) -> None:
        self.fail_creates, self.fail_status, self.fail_exec = 0, 503, False
        self.creates = self.commands = self.peak_live = 0
        self.create_bodies: list[dict] = []
        self.sandboxes: dict[str, dict[str, Any]] = {}  # id -> {"dto": ..., "local": LocalSandbox}
        self._teardowns: set[asyncio.Task[None]] = set()  # deleted sandboxes whose processes and files still go
        self.deleted: list[str] = []
        self.held: dict[str, int] = {"create": 0, "exec": 0}  # requests waiting at a closed gate
        self._gates: dict[str, asyncio.Event] = {}
        self._changed = threading.Condition()
        self._loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self.port = 0

    # -- the test's side ------------------------------------------------------------------------------

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    @property
    def env(self) -> dict[str, str]:
        """The environment that points the SDK here."""
        return {"DAYTONA_API_URL": self.api_url, "DAYTONA_API_KEY": API_KEY}

    def start(self) -> DaytonaStandIn:
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready,), name="daytona-standin", daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError("the Daytona stand-in did not start")
        return self

    def stop(self) -> None:
        """Delete what is left (killing its processes) and stop serving."""
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(60)
        self._loop.close()

    def reset(self) -> None:
        """Forget what was seen and every failure asked for; open the gates (between tests)."""
        self.fail_creates, self.fail_status, self.fail_exec = 0, 503, False
        self.creates = self.commands = self.peak_live = 0
        self.create_bodies, self.deleted = [], []
        for what in list(self.held):
            self.release(what)

    def hold(self, what: str) -> None:
        """From now on, ``what`` ("create" or "exec") requests wait, counted in ``held``, until :meth:`release`."""
        self._on_loop(lambda: self._gates.setdefault(what, asyncio.Event()))

    def release(self, what: str) -> None:
        gate = self._on_loop(lambda: self._gates.pop(what, None))
        if gate is not None:
            self._on_loop(gate.set)

    def _on_loop(self, call: Callable[[], Any]) -> Any:
        """``call()`` on the service's event loop, done before this returns."""
        async def run() -> Any:
            return call()
        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(30)

    def wait_until(self, condition: Callable[[DaytonaStandIn], bool], timeout_s: float = 120) -> None:
        """Block until ``condition(self)`` holds (checked at every change); AssertionError after ``timeout_s``."""
        with self._changed:
            if not self._changed.wait_for(lambda: condition(self), timeout_s):
                raise AssertionError(f"the stand-in never got there: creates={self.creates}, live="
                                     f"{len(self.sandboxes)}, held={self.held}, deleted={len(self.deleted)}")

    def labels(self) -> list[dict[str, str]]:
        """The labels of every live sandbox."""
        return [dict(s["dto"]["labels"]) for s in list(self.sandboxes.values())]

    # -- serving --------------------------------------------------------------------------------------

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application(middlewares=[self._auth], client_max_size=1 << 30)
        app.add_routes([
            web.post("/api/sandbox", self._create), web.get("/api/sandbox", self._list),
            web.get("/api/sandbox/{id}", self._get), web.delete("/api/sandbox/{id}", self._delete),
            web.get("/toolbox/{id}/work-dir", self._work_dir), web.post("/toolbox/{id}/process/execute", self._execute),
            web.post("/toolbox/{id}/files/bulk-upload", self._upload),
            web.post("/toolbox/{id}/files/bulk-download", self._download),
        ])
        self._runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = self._runner.addresses[0][1]
        ready.set()
        self._loop.run_forever()

    async def _shutdown(self) -> None:
        for gate in self._gates.values():
            gate.set()
        for sandbox in list(self.sandboxes.values()):
            await sandbox["local"].close()
        self.sandboxes.clear()
        await asyncio.gather(*self._teardowns)
        await self._runner.cleanup()

    def _notify(self) -> None:
        with self._changed:
            self.peak_live = max(self.peak_live, len(self.sandboxes))
            self._changed.notify_all()

    async def _gate(self, what: str) -> None:
        gate = self._gates.get(what)
        if gate is not None:
            self.held[what] += 1
            self._notify()
            try:
                await gate.wait()
            finally:
                self.held[what] -= 1

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {API_KEY}":
            return _error(401, "Invalid credentials")
        return await handler(request)

    def _sandbox(self, request: web.Request) -> dict[str, Any]:
        sandbox = self.sandboxes.get(request.match_info["id"])
        if sandbox is None:
            message = f"Sandbox with ID or name {request.match_info['id']} not found"
            raise web.HTTPNotFound(text=json.dumps({"statusCode": 404, "message": message, "error": "Not Found"}),
                                   content_type="application/json")
        return sandbox

    # -- the main API ---------------------------------------------------------------------------------

    async def _create(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.creates += 1
        self.create_bodies.append(body)
        self._notify()
        if self.fail_creates:
            self.fail_creates -= 1
            return _error(self.fail_status, "the stand-in fails this create on purpose")
        sandbox_id = uuid.uuid4().hex[:12]
        dto = {
            "id": sandbox_id, "organizationId": "standin-org", "name": sandbox_id, "snapshot": body.get("snapshot"),
            "user": "daytona", "env": body.get("env") or {}, "labels": body.get("labels") or {}, "public": False,
            "networkBlockAll": bool(body.get("networkBlockAll")), "kvm": False, "target": "standin", "cpu": 1,
            "gpu": 0, "memory": 1, "disk": 3, "state": "creating", "desiredState": "started",
            "autoStopInterval": body.get("autoStopInterval"), "autoDeleteInterval": body.get("autoDeleteInterval"),
            "createdAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "toolboxProxyUrl": f"http://127.0.0.1:{self.port}/toolbox",
        }
        self.sandboxes[sandbox_id] = {"dto": dto, "local": LocalSandbox(
            isolation="bwrap", mounts=[ROOT], cwd=ROOT, output_bytes=1 << 26, file_mb=256)}
        self._notify()
        await self._gate("create")
        return web.json_response(dto)

    async def _get(self, request: web.Request) -> web.Response:
        dto = self._sandbox(request)["dto"]
        dto["state"] = "started"  # it started while the client waited
        return web.json_response(dto)

    async def _list(self, request: web.Request) -> web.Response:
        wanted = json.loads(request.query.get("labels") or "{}")
        items = [s["dto"] for s in list(self.sandboxes.values()) if wanted.items() <= s["dto"]["labels"].items()]
        limit = int(request.query.get("limit") or 100)
        return web.json_response({"items": items[:limit], "nextCursor": None})

    async def _delete(self, request: web.Request) -> web.Response:
        sandbox = self._sandbox(request)
        del self.sandboxes[request.match_info["id"]]
        # destroyed at once for the client; its processes and files go in the background (as a VM is torn down),
        # so that how long that takes on a busy test machine never counts against the client's timeout
        teardown = asyncio.ensure_future(sandbox["local"].close())
        self._teardowns.add(teardown)
        teardown.add_done_callback(self._teardowns.discard)
        self.deleted.append(request.match_info["id"])
        self._notify()
        return web.json_response({**sandbox["dto"], "state": "destroyed"})

    # -- the toolbox API ------------------------------------------------------------------------------

    async def _work_dir(self, request: web.Request) -> web.Response:
        self._sandbox(request)
        return web.json_response({"dir": ROOT})

    async def _execute(self, request: web.Request) -> web.Response:
        local = self._sandbox(request)["local"]
        body = await request.json()
        self.commands += 1
        self._notify()
        await self._gate("exec")
        if self.fail_exec:
            return _daemon_error(request, 500, "the stand-in fails this command on purpose")
        text = body["command"] if not body.get("cwd") else f"cd {shlex.quote(body['cwd'])} || exit 1\n{body['command']}"
        try:
            result = await local.run(text, timeout_s=body.get("timeout") or 360)
        except RuntimeError as exc:  # deleted meanwhile
            return _daemon_error(request, 500, str(exc))
        if result.timed_out:
            return _daemon_error(request, 408, "command execution timeout")
        return web.json_response({"exitCode": result.exit_code, "result": result.stdout + result.stderr})

    async def _upload(self, request: web.Request) -> web.Response:
        local = self._sandbox(request)["local"]
        paths: dict[str, str] = {}
        files, errors = [], []
        async for part in await request.multipart():
            index = part.name.removeprefix("files[").split("]")[0]
            if part.name.endswith(".path"):
                paths[index] = (await part.text()).strip()
            elif part.name.endswith(".file"):
                path, data = paths[index], await part.read()
                try:
                    await local.run("true", timeout_s=60, files={path: bytes(data)})
                except ValueError as exc:
                    errors.append(f"{path}: create: {exc}")
                    continue
                files.append({"path": path, "bytes": len(data)})
        return web.json_response({"errors": errors, "files": files} if errors else {"files": files},
                                 status=400 if errors else 200)

    async def _download(self, request: web.Request) -> web.Response:
        local = self._sandbox(request)["local"]
        body = b""
        for path in (await request.json())["paths"]:
            disposition = f"filename=\"{path}\"; filename*=utf-8''{quote(path, safe='')}"
            try:
                data = await local.read_file(path)
                headers = {"Content-Disposition": f'form-data; name="file"; {disposition}',
                           "Content-Type": "application/octet-stream", "Content-Length": str(len(data))}
            except (OSError, ValueError) as exc:  # the daemon answers a file it cannot send with an error part
                data = json.dumps(_daemon_error_body(request, 404, f"file not found: {exc}", "FILE_NOT_FOUND")).encode()
                headers = {"Content-Disposition": f'form-data; name="error"; {disposition}',
                           "Content-Type": "application/json; charset=utf-8"}
            head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            body += f"--{BOUNDARY}\r\n{head}\r\n".encode() + data + b"\r\n"
        body += f"--{BOUNDARY}--\r\n".encode()
        return web.Response(body=body, headers={"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"})


def _error(status: int, message: str) -> web.Response:
    """An error of the main API (its JSON shape)."""
    return web.json_response({"statusCode": status, "message": message, "error": HTTPStatus(status).phrase},
                             status=status)


def _daemon_error_body(request: web.Request, status: int, message: str, code: str | None = None) -> dict:
    return {"statusCode": status, "message": message, "code": code, "path": request.path, "method": request.method,
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _daemon_error(request: web.Request, status: int, message: str) -> web.Response:
    """An error of the toolbox API (the daemon's JSON shape)."""
    return web.json_response(_daemon_error_body(request, status, message), status=status)
