"""A STAND-IN for E2B, for tests only (E2B's service cannot be reached from the test machines).

It serves, on 127.0.0.1 and a free port, the part of E2B's control-plane REST API and of a sandbox's envd
(the daemon inside each E2B sandbox) that the pinned ``e2b`` SDK calls for Miles' ``e2b`` sandbox, in
the wire format that SDK speaks, so the SDK's own code runs against it: its JSON models, the
``X-API-KEY`` and ``X-Access-Token`` headers, paginated lists with metadata filters, Connect-RPC
server streaming for commands and the ``/files`` upload and download.

- REST API: ``POST /v2/sandboxes``, ``GET /v2/sandboxes``, ``DELETE /sandboxes/{id}``.
- envd: ``POST /process.Process/Start`` (server streaming, Connect protocol, JSON codec: enveloped
  messages, then an end-of-stream message), ``POST /process.Process/SendSignal`` (unary),
  ``GET|POST /files`` (octet-stream uploads only) and ``GET /health``. The SDK sends every sandbox's
  envd traffic to ``E2B_SANDBOX_URL`` with the sandbox's id in the ``E2b-Sandbox-Id`` header; the
  stand-in serves both APIs on one port.

It is not E2B: each "sandbox" is a Miles ``LocalSandbox`` (bubblewrap) in which the folder ``/sandbox``
(a mount, empty at first) stands for the sandbox's filesystem, so tests give Miles' ``e2b`` sandbox a
``workdir`` below it. Its isolation is the local sandbox's, and proves nothing about E2B's.

For tests it counts what it saw (creates, deletes, commands, the most sandboxes open at once), can
answer the next creates or every command start with an error, can hold creates until released, and can
hold the answers of creates (their sandboxes made) and the next list requests until released or until the
client goes away.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import itertools
import json
import os
import shlex
import struct
import tempfile
import threading
import urllib.parse
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from aiohttp import web

from miles.agentic.sandboxes.local import LocalSandbox

MOUNT = "/sandbox"  # the stand-in sandbox's filesystem; workdirs of tests go below it
API_KEY = "e2b_standin_key"
ENVD_VERSION = "0.6.5"  # recent enough for every SDK feature Miles uses (octet-stream uploads)
TEMPLATES = ("base",)
END_STREAM = 0b10  # the Connect envelope flag of a stream's last message


@dataclass
class Box:
    """One stand-in sandbox."""

    sandbox_id: str
    template: str
    metadata: dict[str, str]
    token: str
    started: datetime.datetime
    ends: datetime.datetime
    local: LocalSandbox
    processes: dict[int, asyncio.Task] = field(default_factory=dict)
    expiry: asyncio.TimerHandle | None = None


class E2BStandIn:
    """The stand-in server, run in a thread of its own with its own event loop (``start``/``stop``).

    Counters and the records read by tests: ``creates`` (create requests, failed ones included),
    ``created``, ``deleted``, ``refused`` (the requests without the API key), ``commands`` and ``ran`` (the
    commands started), ``signals`` (``(pid, signal)`` of each kill), ``max_open`` (the most sandboxes live
    or being created at once), ``held`` (creates waiting at the gate), ``held_answers`` (creates whose
    sandbox is made, waiting to answer), ``held_lists`` (list requests waiting), ``create_bodies`` (the JSON
    of every create request), ``live()``.
    Knobs: ``fail_creates`` (answer the next N creates with ``fail_status``), ``fail_exec`` (answer
    every command start with HTTP 500), ``hold_creates()``/``release_creates()``, ``hold_answers()``
    and ``hold_lists(n)`` (until ``reset()`` or the client goes away).
    """

    def __init__(self) -> None:
        self.url = ""
        self.boxes: dict[str, Box] = {}
        self._teardowns: set[asyncio.Task[None]] = set()  # deleted sandboxes whose processes and files still go
        self.creates = self.created = self.deleted = self.commands = 0
        self.refused: list[str] = []  # the requests without the API key: "METHOD /path"
        self.creating = self.max_open = self.held = self.held_answers = self.held_lists = 0
        self._lists_to_hold = 0
        self.create_bodies: list[dict[str, Any]] = []
        self.ran: list[str] = []  # the command lines started, as E2B got them
        self.signals: list[tuple[int, str]] = []  # (pid, signal) of every SendSignal
        self.fail_creates, self.fail_status, self.fail_exec = 0, 500, False
        self._changed = threading.Condition()
        self._pids = itertools.count(1000)
        self._workspaces = tempfile.TemporaryDirectory(prefix="e2b-standin-")
        os.chmod(self._workspaces.name, 0o711)  # commands run as nobody when the tests run as root
        self._loop = asyncio.new_event_loop()
        self._gate = asyncio.Event()
        self._gate.set()
        self._answers, self._lists = asyncio.Event(), asyncio.Event()  # set: nothing held
        self._answers.set()
        self._lists.set()
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    # -- control, from the test's thread ---------------------------------------------------------------

    def start(self) -> E2BStandIn:
        started = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(started,), name="e2b-standin", daemon=True)
        self._thread.start()
        if not started.wait(60) or not self.url:
            raise RuntimeError("the E2B stand-in did not start")
        return self

    def stop(self) -> None:
        """Delete every sandbox, stop serving and end the thread."""
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(60)
        self._workspaces.cleanup()

    def env(self) -> dict[str, str]:
        """The SDK's environment variables that point it here."""
        return {"E2B_API_KEY": API_KEY, "E2B_API_URL": self.url, "E2B_SANDBOX_URL": self.url}

    def live(self) -> list[str]:
        return list(self.boxes)

    def remove_all(self) -> None:
        """Delete every sandbox (what a test left behind)."""
        asyncio.run_coroutine_threadsafe(self._remove_all(), self._loop).result(60)

    def reset(self) -> None:
        """Forget the counts and knobs of the last test (sandboxes still live stay)."""
        with self._changed:
            self.creates = self.created = self.deleted = self.commands = 0
            self.max_open = len(self.boxes)
            self.create_bodies, self.ran, self.refused, self.signals = [], [], [], []
            self.fail_creates, self.fail_status, self.fail_exec = 0, 500, False
        self.release_creates()
        self._on_loop(self._release_held)

    def wait_until(self, condition: Callable[[], bool], timeout_s: float = 120.0) -> bool:
        """Block until ``condition()`` holds (checked at every change of the stand-in's state); a safety
        net of ``timeout_s``, not a measurement. From async code: ``await asyncio.to_thread(...)``."""
        with self._changed:
            return self._changed.wait_for(condition, timeout_s)

    def poke(self) -> None:
        """Wake ``wait_until`` to check its condition again (for conditions on things outside the stand-in)."""
        self._changing()

    def hold_creates(self) -> None:
        self._loop.call_soon_threadsafe(self._gate.clear)

    def release_creates(self) -> None:
        self._loop.call_soon_threadsafe(self._gate.set)

    def hold_answers(self) -> None:
        """From now on a create makes its sandbox (live, counted as created) and then waits to answer."""
        self._on_loop(self._answers.clear)

    def hold_lists(self, count: int) -> None:
        """The next ``count`` list requests wait (the ones after are answered)."""
        def hold() -> None:
            self._lists_to_hold = count
            self._lists.clear()

        self._on_loop(hold)

    def _release_held(self) -> None:
        self._lists_to_hold = 0
        self._answers.set()
        self._lists.set()

    def _on_loop(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the server's loop, done when this returns."""
        async def call() -> None:
            fn()

        asyncio.run_coroutine_threadsafe(call(), self._loop).result(60)

    # -- the server -------------------------------------------------------------------------------------

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application(client_max_size=256 << 20, middlewares=[self._errors])
        app.add_routes([
            web.post("/v2/sandboxes", self._create), web.get("/v2/sandboxes", self._list),
            web.delete("/sandboxes/{sandbox_id}", self._delete),
            web.post("/process.Process/Start", self._start), web.post("/process.Process/SendSignal", self._signal),
            web.get("/files", self._download), web.post("/files", self._upload), web.get("/health", self._health),
        ])
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        started.set()
        self._loop.run_forever()
        self._loop.close()

    async def _remove_all(self) -> None:
        for sandbox_id in list(self.boxes):
            self._remove(sandbox_id)
        await asyncio.gather(*self._teardowns)

    async def _shutdown(self) -> None:
        await self._remove_all()
        await self._runner.cleanup()

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Refuse requests without the API key (REST) or the sandbox's access token (envd)."""
        if request.path.startswith(("/v2/", "/sandboxes")):
            if request.headers.get("X-API-KEY") != API_KEY:
                self.refused.append(f"{request.method} {request.path}")
                self._changing()
                return _error(401, "Invalid API key")
        elif request.path != "/health":
            box = self.boxes.get(request.headers.get("E2b-Sandbox-Id", ""))
            if box is None:
                return _error(502, "The sandbox was not found")
            if request.headers.get("X-Access-Token") != box.token:
                return _error(401, "invalid access token")
        return await handler(request)

    def _box(self, request: web.Request) -> Box:
        """The sandbox an envd request is for (the middleware checked that it exists)."""
        return self.boxes[request.headers["E2b-Sandbox-Id"]]

    def _changing(self, **changes: int) -> None:
        with self._changed:
            for name, delta in changes.items():
                setattr(self, name, getattr(self, name) + delta)
            self.max_open = max(self.max_open, len(self.boxes) + self.creating)
            self._changed.notify_all()

    # -- REST API ---------------------------------------------------------------------------------------

    async def _create(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.create_bodies.append(body)
        self._changing(creates=1, creating=1)
        try:
            answer = await self._make(body)
        except BaseException:
            self._changing(creating=-1)
            raise
        self._changing(creating=-1, created=int(answer.status == 201))
        if answer.status == 201 and not self._answers.is_set():
            self._changing(held_answers=1)
            try:
                await self._answers.wait()  # cancelled when the client goes away
            finally:
                self._changing(held_answers=-1)
        return answer

    async def _make(self, body: dict[str, Any]) -> web.Response:
        if not self._gate.is_set():
            self._changing(held=1)
            try:
                await self._gate.wait()
            finally:
                self._changing(held=-1)
        if self.fail_creates > 0:
            self.fail_creates -= 1
            return _error(self.fail_status, "stand-in: injected failure of a create")
        template = body.get("templateID")
        if template not in TEMPLATES:
            return _error(404, f"template '{template}' not found")
        now = datetime.datetime.now(datetime.timezone.utc)
        lifetime = int(body.get("timeout", 15))
        box = Box(sandbox_id="i" + uuid.uuid4().hex[:19], template=template, metadata=body.get("metadata") or {},
                  token=uuid.uuid4().hex, started=now, ends=now + datetime.timedelta(seconds=lifetime),
                  local=LocalSandbox(isolation="bwrap", mounts=[MOUNT], output_bytes=1 << 20,
                                     workspace_root=self._workspaces.name))
        box.expiry = self._loop.call_later(lifetime, self._remove, box.sandbox_id)
        self.boxes[box.sandbox_id] = box  # counted as open by the caller's change, with creating -1
        return web.json_response({"templateID": template, "sandboxID": box.sandbox_id, "clientID": "standin",
                                  "envdVersion": ENVD_VERSION, "envdAccessToken": box.token, "domain": None},
                                 status=201)

    async def _list(self, request: web.Request) -> web.Response:
        if self._lists_to_hold > 0:
            self._lists_to_hold -= 1
            self._changing(held_lists=1)
            try:
                await self._lists.wait()  # cancelled when the client goes away
            finally:
                self._changing(held_lists=-1)
        wanted = {urllib.parse.unquote(k): urllib.parse.unquote(v)
                  for k, v in urllib.parse.parse_qsl(request.query.get("metadata", ""))}
        found = sorted(box for box, b in self.boxes.items() if wanted.items() <= b.metadata.items())
        after = request.query.get("nextToken")
        if after:
            found = [sandbox_id for sandbox_id in found if sandbox_id > after]
        limit = int(request.query.get("limit", 100))
        page, more = found[:limit], len(found) > limit
        listed = [{"templateID": b.template, "sandboxID": b.sandbox_id, "clientID": "standin",
                   "startedAt": b.started.isoformat(), "endAt": b.ends.isoformat(), "cpuCount": 2, "memoryMB": 512,
                   "diskSizeMB": 1024, "state": "running", "envdVersion": ENVD_VERSION, "metadata": b.metadata}
                  for b in map(self.boxes.__getitem__, page)]
        return web.json_response(listed, headers={"x-next-token": page[-1]} if more else {})

    async def _delete(self, request: web.Request) -> web.Response:
        if not self._remove(request.match_info["sandbox_id"]):
            return _error(404, "sandbox not found")
        return web.Response(status=204)

    def _remove(self, sandbox_id: str) -> bool:
        """Delete a sandbox as the service does: gone from the list and its commands killed at once, counted as
        deleted; its processes end and its files go in the background (as a VM is torn down after the answer),
        so that how long that takes on a busy test machine never counts against the client's timeout. The
        tests see its processes end (``wait_until_gone``); ``stop`` and ``remove_all`` wait for it."""
        box = self.boxes.pop(sandbox_id, None)
        if box is None:
            return False
        if box.expiry is not None:
            box.expiry.cancel()
        for task in box.processes.values():
            task.cancel()
        teardown = asyncio.ensure_future(self._tear_down(box))
        self._teardowns.add(teardown)
        teardown.add_done_callback(self._teardowns.discard)
        self._changing(deleted=1)
        return True

    @staticmethod
    async def _tear_down(box: Box) -> None:
        await asyncio.gather(*box.processes.values(), return_exceptions=True)
        await box.local.close()

    # -- envd -------------------------------------------------------------------------------------------

    async def _start(self, request: web.Request) -> web.StreamResponse:
        """Run ``process.cmd`` with its ``args`` in ``process.cwd`` and stream its start, output and end."""
        if self.fail_exec:
            return _error(500, "stand-in: injected failure of envd")
        box = self._box(request)
        body = await request.read()
        if self.boxes.get(box.sandbox_id) is not box:  # deleted while the body was read: as the middleware says
            return _error(502, "The sandbox was not found")  # (a command registered later would never be killed)
        _, size = struct.unpack(">BI", body[:5])
        process = json.loads(body[5:5 + size]).get("process", {})
        command = shlex.join([process["cmd"], *process.get("args", [])])
        if process.get("cwd"):
            command = f"cd {shlex.quote(process['cwd'])} && {command}"
        deadline_s = int(request.headers.get("Connect-Timeout-Ms", 3_600_000)) / 1000
        pid = next(self._pids)
        task = asyncio.ensure_future(box.local.run(command, timeout_s=deadline_s))
        box.processes[pid] = task
        self.ran.append(command)
        self._changing(commands=1)
        response = web.StreamResponse(headers={"Content-Type": "application/connect+json"})
        await response.prepare(request)
        try:
            await response.write(_envelope({"event": {"start": {"pid": pid}}}))
            await asyncio.wait({task})
        finally:
            task.cancel()  # the client went away: so does the command
            box.processes.pop(pid, None)
        end: dict[str, Any] = {}
        if task.cancelled():  # SendSignal, or the sandbox was deleted
            if box.sandbox_id in self.boxes:
                await response.write(_envelope({"event": {"end": {"exitCode": -1, "status": "signal: killed"}}}))
            else:
                end = {"error": {"code": "unavailable", "message": "the sandbox was killed"}}
        elif task.exception() is not None:
            end = {"error": {"code": "internal", "message": str(task.exception())}}
        elif task.result().timed_out:
            end = {"error": {"code": "deadline_exceeded", "message": "the command ran past its deadline"}}
        else:
            result = task.result()
            for stream in ("stdout", "stderr"):
                data = getattr(result, stream).encode()
                if data:
                    await response.write(_envelope({"event": {"data": {stream: base64.b64encode(data).decode()}}}))
            code = result.exit_code
            await response.write(_envelope({"event": {"end": {"exitCode": code, "exited": True,
                                                              "status": f"exit status {code}"}}}))
        await response.write(_envelope(end, END_STREAM))
        await response.write_eof()
        return response

    async def _signal(self, request: web.Request) -> web.Response:
        box = self._box(request)
        body = await request.json()
        pid = int(body.get("process", {}).get("pid", -1))
        self.signals.append((pid, body.get("signal", "")))
        task = box.processes.get(pid)
        if task is None or task.done():
            return web.json_response({"code": "not_found", "message": "process not found"}, status=404)
        task.cancel()
        return web.json_response({})

    async def _upload(self, request: web.Request) -> web.Response:
        box = self._box(request)
        if request.content_type != "application/octet-stream":
            return _error(400, f"the stand-in takes octet-stream uploads only, got {request.content_type}")
        path = request.query["path"]
        try:
            await box.local.run("true", timeout_s=60, files={path: await request.read()})
        except ValueError as exc:
            return _error(400, str(exc))
        return web.json_response([{"name": path.rsplit("/", 1)[-1], "type": "file", "path": path}])

    async def _download(self, request: web.Request) -> web.Response:
        box = self._box(request)
        try:
            data = await box.local.read_file(request.query["path"])
        except FileNotFoundError:
            return _error(404, f"path '{request.query['path']}' does not exist")
        except (ValueError, OSError) as exc:
            return _error(400, str(exc))
        return web.Response(body=data, content_type="application/octet-stream")

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=204)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"code": status, "message": message}, status=status)


def _envelope(message: dict[str, Any], flags: int = 0) -> bytes:
    data = json.dumps(message).encode()
    return struct.pack(">BI", flags, len(data)) + data
