"""The Miles side of the worker: one process per env spec, shared by every sample that uses it.

A worker is started on first use and kept for the life of the Miles process (loading verifiers and the env
takes seconds, and Miles may run each step in a fresh event loop), so its pipes are read by a thread and
answers reach callers through ``concurrent.futures`` futures, whatever their event loop. It runs in a session
of its own (Ctrl-C goes to Miles, which closes it); it exits when its stdin closes, so it never outlives
Miles. :func:`close_workers` (also run at exit) shuts every worker down and waits for it.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import json
import os
import signal
import subprocess
import threading
from concurrent.futures import Future, InvalidStateError
from typing import Any

from miles_verifiers.spec import EnvSpec

__all__ = ["Worker", "WorkerError", "worker_for", "close_workers"]

SHUTDOWN_TIMEOUT_S = 60.0  # a safety net: the worker closes its env's servers and rollouts first


class WorkerError(RuntimeError):
    """A request the worker answered with an error, or that it could not answer because it exited."""


class Worker:
    def __init__(self, spec: EnvSpec) -> None:
        self.spec = spec
        self.process = subprocess.Popen(spec.command("serve"), env=spec.environ(), stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, bufsize=1, start_new_session=True)
        self.ready: Future[None] = Future()
        self._pending: dict[int, Future[dict[str, Any]]] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name=f"verifiers worker {spec.env}", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self.process.poll() is None and not (self.ready.done() and self.ready.exception())

    async def call(self, op: str, **payload: Any) -> dict[str, Any]:
        """Send one request and wait for its result; cancelling the caller cancels the request in the worker."""
        with self._lock:
            request_id = next(self._ids)
            future: Future[dict[str, Any]] = Future()
            self._pending[request_id] = future
        self._send({"id": request_id, "op": op, **payload})
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self._send({"op": "cancel", "id": request_id})
            raise

    def _send(self, message: dict[str, Any]) -> None:
        with self._lock:
            try:
                self.process.stdin.write(json.dumps(message) + "\n")
                self.process.stdin.flush()
            except (BrokenPipeError, ValueError):  # it exited; the reader fails what is pending
                pass

    def _read(self) -> None:
        """Deliver each answer to its request; when the worker exits, fail whatever still waits."""
        failure = "the verifiers worker exited"
        for line in self.process.stdout:
            message = json.loads(line)
            if message.get("ready"):
                self.ready.set_result(None)
            elif "id" not in message:  # it could not start: the env did not load
                failure = f"the verifiers worker for env {self.spec.env!r} failed: {message.get('error')}"
            else:
                with self._lock:
                    future = self._pending.pop(message["id"], None)
                if "error" in message:
                    _settle(future, error=WorkerError(message["error"]))
                else:
                    _settle(future, result=message["result"])
        code = self.process.wait()
        error = WorkerError(f"{failure} (exit code {code})")
        _settle(self.ready, error=error)
        with self._lock:
            pending, self._pending = self._pending, {}
        for future in pending.values():
            _settle(future, error=error)

    def close(self) -> None:
        """Ask the worker to stop (its rollouts are cancelled and its env's servers closed) and wait for it."""
        self._send({"op": "shutdown"})
        with self._lock:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=SHUTDOWN_TIMEOUT_S)
        except subprocess.TimeoutExpired:  # its process group (start_new_session: the group id is its pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self._reader.join()


def _settle(future: Future | None, result: Any = None, error: BaseException | None = None) -> None:
    """Complete a future unless it is gone or already done (its caller was cancelled)."""
    if future is None:
        return
    with contextlib.suppress(InvalidStateError):
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


_workers: dict[EnvSpec, Worker] = {}
_workers_lock = threading.Lock()


def worker_for(spec: EnvSpec) -> Worker:
    """The running worker of this spec, started now if there is none (or the last one died)."""
    with _workers_lock:
        worker = _workers.get(spec)
        if worker is None or not worker.alive:
            worker = _workers[spec] = Worker(spec)
        return worker


def close_workers() -> None:
    """Shut every worker down (tests call it between checks; it also runs when Miles exits)."""
    with _workers_lock:
        workers = list(_workers.values())
        _workers.clear()
    for worker in workers:
        worker.close()


atexit.register(close_workers)
