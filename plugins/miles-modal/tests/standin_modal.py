"""A STAND-IN for Modal's service, for the tests only. It is not Modal.

Modal's SDK reaches its sandboxes through a gRPC control plane and a separate command router per worker, so,
as Modal's own tests do, this stands in at the SDK's Python API instead of on the wire: it replaces the few
``modal`` objects the plugin calls (all in ``miles_modal/sdk.py``: ``App.lookup``, ``Client.from_env``,
``Sandbox.create``, ``Sandbox.list``, ``Sandbox.from_id``) with stand-ins that keep the pinned SDK's
signatures (``test_the_standin_keeps_the_sdk_signatures`` checks them) and the SDK's async form (awaited as
``.aio``). Its sandboxes run their commands in Miles' ``local`` sandbox (bubblewrap), with the top-level
folders in ``mounts`` (the sandbox's working folder) writable and the rest of this machine read-only, where
a Modal sandbox is a container of its own.

What the "service" holds (sandboxes, their app, tags and lifetime, how many commands ran, terminated or not)
is kept in files under one folder, so that a ``miles`` process a test starts through this module
(``python standin_modal.py train ...`` with ``MILES_MODAL_STANDIN`` naming the folder) and the test see the
same service: what a killed run leaves there, ``gc`` in the test deletes.

Knobs for the tests: ``fail[op]`` (errors the next calls of ``op`` raise, one each), ``fail_always[op]``, and
``gates[op]`` (an event that calls of ``op`` wait for: a create once the sandbox exists there, as a service
that made it but has not answered yet; ``hello``: a service that never answers), counted in ``waiting[op]``.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import sys
import tempfile
import uuid
from collections import Counter, defaultdict
from pathlib import Path, PurePosixPath
from typing import Any, Callable

import modal
import modal.exception

from miles.agentic.sandboxes.local import LocalSandbox

STANDIN_ENV = "MILES_MODAL_STANDIN"  # the stand-in's folder, for a miles process started through this module
CHUNK = 64 * 1024  # output comes back in chunks of this size, as a stream would
OUTPUT_LIMIT = 64 << 20  # the local sandbox's own cap, far above the plugin's (which the tests check)


class Aio:
    """A callable of the SDK as synchronicity makes it: the plugin awaits ``.aio(...)``."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.aio = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("the Modal stand-in serves the SDK's async interface (.aio) only")


class StandInModal:
    """The service's side, in the folder ``root``; see the module docstring."""

    def __init__(self, root: str | Path, mounts: tuple[str, ...] = ("/workspace",)) -> None:
        self.root, self.mounts = Path(root), tuple(mounts)
        for folder in ("apps", "sandboxes"):
            (self.root / folder).mkdir(parents=True, exist_ok=True)
        self.here: dict[str, StandInSandbox] = {}  # sandboxes made by this process, by id
        self.fail: defaultdict[str, list[BaseException]] = defaultdict(list)
        self.fail_always: dict[str, BaseException] = {}
        self.calls: Counter[str] = Counter()
        self.gates: dict[str, asyncio.Event] = {}
        self.waiting: Counter[str] = Counter()
        self.peak_live = 0

    def install(self, patch: Callable[[Any, str, Any], None] = setattr) -> None:
        """Put the stand-ins in place of the SDK's objects (``patch``: e.g. pytest's ``monkeypatch.setattr``)."""
        patch(modal.App, "lookup", Aio(self.app_lookup))
        patch(modal.Client, "from_env", Aio(self.client_from_env))
        patch(modal.Sandbox, "create", Aio(self.sandbox_create))
        patch(modal.Sandbox, "list", Aio(self.sandbox_list))
        patch(modal.Sandbox, "from_id", Aio(self.sandbox_from_id))

    # -- what the tests look at -----------------------------------------------------------------------

    def records(self) -> list[dict[str, Any]]:
        """Every sandbox the service has seen, terminated or not."""
        return [json.loads(path.read_text()) for path in sorted((self.root / "sandboxes").glob("*.json"))]

    def live(self) -> list[dict[str, Any]]:
        return [record for record in self.records() if not record["terminated"]]

    # -- the SDK's functions --------------------------------------------------------------------------

    async def app_lookup(self, name: str, *, client: Any = None, environment_name: str | None = None,
                         create_if_missing: bool = False) -> StandInApp:
        self._call("lookup")
        path = self.root / "apps" / name
        if not path.exists():
            if not create_if_missing:
                raise modal.exception.NotFoundError(f"App '{name}' not found")
            try:
                with open(path, "x") as file:  # one app by that name, whichever process makes it first
                    file.write(f"ap-standin-{uuid.uuid4().hex[:10]}")
            except FileExistsError:
                pass
        return StandInApp(path.read_text(), name)

    async def client_from_env(self, _override_config: Any = None) -> StandInClient:
        self._call("connect")
        return StandInClient(self)

    async def sandbox_create(self, *args: str, app: Any = None, tags: dict[str, str] | None = None,
                             image: Any = None, timeout: int | None = 300, cpu: float | None = None,
                             memory: int | None = None, block_network: bool = False) -> StandInSandbox:
        self._call("create")
        if not isinstance(app, StandInApp):
            raise modal.exception.InvalidError("App is required to create a Sandbox (the stand-in's App.lookup)")
        if not isinstance(image, modal.Image):
            raise modal.exception.InvalidError(f"image: expected a modal.Image, got {image!r}")
        record = {"id": f"sb-standin-{uuid.uuid4().hex[:12]}", "app_id": app.app_id, "tags": dict(tags or {}),
                  "timeout": timeout, "block_network": block_network, "cpu": cpu, "memory": memory,
                  "pid": os.getpid(), "commands": 0, "terminated": False}
        local = self._local(record)
        self._save(record)  # it exists there from here on, also when this create is never answered
        self.peak_live = max(self.peak_live, len(self.live()))
        sandbox = StandInSandbox(self, record["id"], local)
        self.here[record["id"]] = sandbox
        await self._gate("create")
        return sandbox

    async def sandbox_list(self, *, app_id: str | None = None, tags: dict[str, str] | None = None,
                           client: Any = None):
        self._call("list")
        for record in self.live():
            if (app_id is None or record["app_id"] == app_id) and (tags or {}).items() <= record["tags"].items():
                yield self.here.get(record["id"]) or StandInSandbox(self, record["id"], None)

    async def sandbox_from_id(self, sandbox_id: str, client: Any = None) -> StandInSandbox:
        self._call("from_id")
        if not (self.root / "sandboxes" / f"{sandbox_id}.json").exists():
            raise modal.exception.NotFoundError(f"Sandbox {sandbox_id} not found")
        return self.here.get(sandbox_id) or StandInSandbox(self, sandbox_id, None)

    # -- internals ------------------------------------------------------------------------------------

    def _call(self, op: str) -> None:
        """Count a call of ``op`` and raise the error injected for it, if any."""
        self.calls[op] += 1
        if op in self.fail_always:
            raise self.fail_always[op]
        if self.fail[op]:
            raise self.fail[op].pop(0)

    async def _gate(self, op: str) -> None:
        if op in self.gates:
            self.waiting[op] += 1
            await self.gates[op].wait()

    def _local(self, record: dict[str, Any]) -> LocalSandbox:
        """The local sandbox that runs a new sandbox's commands, its workspace in a folder of its own (which
        uid nobody can reach: commands run as nobody when the tests run as root)."""
        record["workspaces"] = tempfile.mkdtemp(prefix=f"miles-modal-standin-{record['id']}-")
        os.chmod(record["workspaces"], 0o711)
        return LocalSandbox(isolation="bwrap", mounts=list(self.mounts), workspace_root=record["workspaces"],
                            output_bytes=OUTPUT_LIMIT)

    def _record(self, sandbox_id: str) -> dict[str, Any]:
        return json.loads((self.root / "sandboxes" / f"{sandbox_id}.json").read_text())

    def _save(self, record: dict[str, Any]) -> None:
        path = self.root / "sandboxes" / f"{record['id']}.json"
        temporary = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:6]}")
        temporary.write_text(json.dumps(record))
        os.replace(temporary, path)  # readers in other processes see the old record or the new one

    def _count_command(self, sandbox_id: str) -> None:
        record = self._record(sandbox_id)
        record["commands"] += 1
        self._save(record)

    async def _terminate(self, sandbox_id: str) -> None:
        sandbox = self.here.pop(sandbox_id, None)
        if sandbox is not None and sandbox.local is not None:
            await sandbox.local.close()
        record = self._record(sandbox_id)
        record["terminated"] = True
        self._save(record)
        shutil.rmtree(record["workspaces"], ignore_errors=True)


class StandInApp:
    def __init__(self, app_id: str, name: str) -> None:
        self.app_id, self.name = app_id, name


class StandInClient:
    def __init__(self, service: StandInModal) -> None:
        self._service = service
        self.hello = Aio(self._hello)

    async def _hello(self) -> None:
        self._service._call("hello")
        await self._service._gate("hello")


class StandInSandbox:
    """A sandbox handle: ``exec``, ``filesystem`` and ``terminate``. Commands run in ``local``, which only the
    process that made the sandbox has (a handle from ``list`` or ``from_id`` elsewhere can only terminate it)."""

    def __init__(self, service: StandInModal, sandbox_id: str, local: LocalSandbox | None) -> None:
        self._service, self.object_id, self.local = service, sandbox_id, local
        self.exec = Aio(self._exec)
        self.terminate = Aio(self._terminate)
        self.filesystem = StandInFilesystem(self)

    def _running(self) -> LocalSandbox:
        if self._service._record(self.object_id)["terminated"]:
            raise modal.exception.SandboxTerminatedError(f"Sandbox {self.object_id} has been terminated")
        if self.local is None:
            raise modal.exception.InvalidError("the stand-in runs commands only in sandboxes this process made")
        return self.local

    async def _exec(self, *args: str, timeout: int | None = None, workdir: str | None = None,
                    text: bool = True) -> StandInProcess:
        self._service._call("exec")
        local = self._running()
        self._service._count_command(self.object_id)
        command = shlex.join(args) if workdir is None else f"cd {shlex.quote(workdir)} && {shlex.join(args)}"
        limit = timeout or self._service._record(self.object_id)["timeout"]
        return StandInProcess(asyncio.ensure_future(local.run(command, timeout_s=limit)), text)

    async def _terminate(self, *, wait: bool = False) -> None:
        self._service._call("terminate")
        await self._service._terminate(self.object_id)


class StandInFilesystem:
    """``write_bytes`` and ``read_bytes``, inside the stand-in's mounts (a Modal sandbox's root is writable)."""

    def __init__(self, sandbox: StandInSandbox) -> None:
        self._sandbox = sandbox
        self.write_bytes = Aio(self._write_bytes)
        self.read_bytes = Aio(self._read_bytes)

    async def _write_bytes(self, data: bytes | bytearray | memoryview, remote_path: str) -> None:
        self._sandbox._service._call("write")
        self._check(remote_path, "write_bytes")
        await self._sandbox._running().run("true", timeout_s=60, files={remote_path: bytes(data)})

    async def _read_bytes(self, remote_path: str) -> bytes:
        self._sandbox._service._call("read")
        self._check(remote_path, "read_bytes")
        try:
            return await self._sandbox._running().read_file(remote_path)
        except FileNotFoundError as exc:
            raise modal.exception.SandboxFilesystemNotFoundError(f"{remote_path}: not found") from exc

    def _check(self, path: str, operation: str) -> None:
        if not PurePosixPath(path).is_absolute():
            raise modal.exception.InvalidError(f"Sandbox.filesystem.{operation}() needs an absolute path")


class StandInProcess:
    """A command under way: ``stdout`` and ``stderr`` (async iterables of chunks) and ``wait``, which gives
    -1 for a command killed at its timeout, as the SDK does."""

    def __init__(self, run: asyncio.Future, text: bool) -> None:
        self._run = run
        self.stdout, self.stderr = _Stream(run, "stdout", text), _Stream(run, "stderr", text)
        self.wait = Aio(self._wait)

    async def _wait(self) -> int:
        result = await asyncio.shield(self._run)  # a caller that stops waiting does not stop the command
        return -1 if result.timed_out else result.exit_code


class _Stream:
    def __init__(self, run: asyncio.Future, name: str, text: bool) -> None:
        self._run, self._name, self._text = run, name, text

    async def __aiter__(self):
        data = getattr(await asyncio.shield(self._run), self._name).encode()
        for start in range(0, len(data), CHUNK):
            chunk = data[start:start + CHUNK]
            yield chunk.decode(errors="replace") if self._text else chunk


def main() -> None:
    """``python standin_modal.py ARGS...``: the ``miles`` command line with the stand-in in place of Modal's
    service (its folder in ``MILES_MODAL_STANDIN``) and Ctrl-C restored (see ``miles.testing.MILES_WITH_CTRL_C``)."""
    import runpy
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)
    StandInModal(os.environ[STANDIN_ENV]).install()
    sys.argv = ["miles", *sys.argv[1:]]
    runpy.run_module("miles", run_name="__main__")


if __name__ == "__main__":
    main()
