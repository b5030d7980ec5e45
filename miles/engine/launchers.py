"""Server launchers: how an engine actor brings up the HTTP server it stands for.

A rollout engine registered with ``server_launcher = True`` is a *server launcher*: built with the
``rollout.engine`` node's arguments (in the driver, so that bad arguments fail before anything starts),
shipped to each engine actor, and there asked to

- ``start(model_path, *, host, port, admin_token, threads, timeout_s) -> url``: serve ``model_path`` with
  SGLang's protocol on ``host:port`` (admin endpoints behind ``admin_token`` when it is not empty) and
  return once it answers, or raise :class:`~miles.errors.RunError` naming why (with the server's log);
- ``alive() -> bool``: whether the server still runs (the actor exits when it stops, and Ray restarts it);
- ``stop()``: stop it and everything it started;
- ``gpus``: the GPUs one server needs (its actor's bundle reserves them; 0 on CPU);
- ``describe() -> dict``: what the driver and the weight transports may know (``protocol``: ``miles`` or
  ``sglang``, ``tp_size``, the command, the log file).

:class:`EmbeddedLauncher` serves the in-process ``local`` engine from a thread of the actor (the default);
:class:`SubprocessLauncher` runs a command in a process group of its own; :class:`MilesServerLauncher`
runs ``miles engine serve`` that way (registered as ``miles_server``), and the ``miles-sglang`` plugin runs
``python -m sglang.launch_server``.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from miles.engine.speculative import SpeculativeConfig
from miles.errors import RunError
from miles.models.sampling import LOGPROBS_OF

__all__ = ["EmbeddedLauncher", "SubprocessLauncher", "MilesServerLauncher", "log_tail"]


class EmbeddedLauncher:
    """The in-process engine (``local``), served with :func:`miles.engine.server.build_app` by a thread of the
    actor; it lives and dies with the actor's process."""

    server_launcher = True
    protocol = "miles"

    def __init__(self, engine_args: dict[str, Any]) -> None:
        self.engine_args = dict(engine_args)
        self.engine: Any = None
        self.gpus = 1.0 if self.engine_args.get("device") == "cuda" else 0.0

    def start(self, model_path: str, *, host: str, port: int, admin_token: str, threads: int,
              timeout_s: float = 120.0) -> str:
        import asyncio
        import threading

        import torch
        from aiohttp import web

        from miles.engine.local import LocalEngine
        from miles.engine.server import app_runner, build_app

        torch.set_num_threads(threads)
        self.engine = LocalEngine(**{**self.engine_args, "background": True})
        self.engine.load_model(model_path)
        loop = asyncio.new_event_loop()
        runner = app_runner(build_app(self.engine, admin_token))
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, host, port).start())
        threading.Thread(target=loop.run_forever, name="miles-engine-http", daemon=True).start()
        return f"http://{host}:{port}"

    def alive(self) -> bool:
        return True

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.close()

    def describe(self) -> dict[str, Any]:
        return {"protocol": self.protocol, "tp_size": 1, "pid": os.getpid()}


def log_tail(path: str | Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file ('' when there is none)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the thread that started it dies (Linux), so that a server
    never outlives its engine actor, however the actor ends."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _group_alive(pgid: int) -> list[int]:
    """The processes of group ``pgid`` that have not yet exited (zombies have: they only wait to be reaped)."""
    members = []
    try:
        entries = os.listdir("/proc")
    except OSError:  # no procfs: nothing to look at
        return members
    for entry in entries:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as file:
                    fields = file.read().rsplit(")", 1)[1].split()
            except OSError:
                continue  # it ended meanwhile
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                members.append(int(entry))
    return members


def _wait_until_gone(pgid: int, *, timeout_s: float) -> None:
    """Return once every process of group ``pgid`` has exited: a SIGKILL is delivered, not yet acted on, when
    ``killpg`` returns, and whoever stops a server may look at its processes next."""
    deadline = time.monotonic() + timeout_s
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.02)


class SubprocessLauncher:
    """A server command in a session (process group) of its own, its output in a log file.

    Subclasses give :meth:`command` (the argv) and may set ``ready_path`` (polled until it answers 200 within
    ``timeout_s``), ``environment`` and ``protocol``. ``stop`` sends SIGTERM to the group and SIGKILL after
    ``stop_timeout_s``; a server whose actor dies is killed by the kernel (parent-death signal)."""

    server_launcher = True
    protocol = "miles"
    ready_path = "/health"
    name = "engine server"
    gpus = 0.0

    def __init__(self, *, startup_timeout_s: float | None = None, stop_timeout_s: float = 10.0,
                 log_dir: str | None = None) -> None:
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.log_dir = log_dir
        self.argv: list[str] = []
        self.log_path = ""
        self._proc: subprocess.Popen | None = None

    # -- what subclasses give ----------------------------------------------------------------------

    def command(self, model_path: str, *, host: str, port: int, admin_token: str, threads: int) -> list[str]:
        raise NotImplementedError

    def environment(self, *, threads: int, admin_token: str) -> dict[str, str]:
        return {"OMP_NUM_THREADS": str(threads)}

    def missing_packages(self) -> list[str]:
        """What the server needs and this machine lacks, each named with how to get it (checked before the run
        starts: ``miles config``)."""
        return []

    @property
    def tp_size(self) -> int:
        return 1

    # -- the process -------------------------------------------------------------------------------

    def start(self, model_path: str, *, host: str, port: int, admin_token: str, threads: int,
              timeout_s: float = 120.0) -> str:
        self.argv = self.command(model_path, host=host, port=port, admin_token=admin_token, threads=threads)
        if self.log_dir:
            Path(self.log_dir).mkdir(parents=True, exist_ok=True)
        fd, self.log_path = tempfile.mkstemp(prefix=f"miles-{self.protocol}-{port}-", suffix=".log", dir=self.log_dir)
        env = {**os.environ, **self.environment(threads=threads, admin_token=admin_token)}
        try:
            with os.fdopen(fd, "wb") as log:
                self._proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              env=env, start_new_session=True, preexec_fn=_die_with_parent)
        except OSError as exc:
            raise RunError(f"{self.name}: could not run {self.argv[0]!r}: {exc}") from exc
        url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
        timeout_s = self.startup_timeout_s or timeout_s
        deadline = time.monotonic() + timeout_s
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        while True:
            code = self._proc.poll()
            if code is not None:
                self.stop()
                raise RunError(f"{self.name} exited with code {code} before it answered {self.ready_path}: "
                               f"{self._what()}")
            if self._answers(url + self.ready_path, headers):
                return url
            if time.monotonic() > deadline:
                self.stop()
                raise RunError(f"{self.name} did not answer {self.ready_path} within {timeout_s:g} s "
                               f"(startup_timeout_s): {self._what()}")
            time.sleep(0.1)

    @staticmethod
    def _answers(url: str, headers: dict[str, str]) -> bool:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as resp:
                return resp.status == 200
        except (OSError, urllib.error.HTTPError):
            return False

    def _what(self) -> str:
        tail = log_tail(self.log_path)
        return (f"{' '.join(self.argv)}\nlast lines of its log ({self.log_path}):\n{tail or '(empty)'}")

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL to what is left after ``stop_timeout_s``."""
        proc = self._proc
        if proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, self.stop_timeout_s), (signal.SIGKILL, 30.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
            try:  # the leader is gone; children it left in the group go too
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            break
        _wait_until_gone(proc.pid, timeout_s=30.0)

    def describe(self) -> dict[str, Any]:
        return {"protocol": self.protocol, "tp_size": self.tp_size, "argv": list(self.argv), "log": self.log_path,
                "pid": self.pid}


class MilesServerLauncher(SubprocessLauncher):
    """``miles engine serve`` in a process of its own (rollout engine ``miles_server``): the embedded engine
    isolated from the actor, and the same process handling as an SGLang server."""

    name = "miles engine serve"
    accepts_lora_adapters = True  # the embedded engine: it merges adapter payloads (backend.lora.sync: adapters)
    logprobs_of_choices = LOGPROBS_OF
    accepts_precision = True

    def __init__(self, seed: int = 0, extra_args: list[str] | None = None, *, startup_timeout_s: float | None = None,
                 stop_timeout_s: float = 10.0, log_dir: str | None = None, logprobs_of: str = "sampling",
                 precision: dict[str, Any] | None = None, speculative: dict[str, Any] | None = None) -> None:
        super().__init__(startup_timeout_s=startup_timeout_s, stop_timeout_s=stop_timeout_s, log_dir=log_dir)
        if speculative is not None:  # checked here, in the driver: a bad draft setting fails before anything starts
            SpeculativeConfig.parse(speculative)
        self.speculative = speculative
        self.seed = seed
        self.extra_args = [str(a) for a in extra_args or []]
        self.logprobs_of = logprobs_of
        self.precision = precision

    def command(self, model_path: str, *, host: str, port: int, admin_token: str, threads: int) -> list[str]:
        argv = [sys.executable, "-m", "miles", "engine", "serve", "--model", str(model_path), "--host", host,
                "--port", str(port), "--seed", str(self.seed), "--logprobs-of", self.logprobs_of]
        if self.precision is not None:
            argv += ["--precision", json.dumps(self.precision)]
        if self.speculative is not None:
            argv += ["--engine-args", json.dumps({"speculative": self.speculative})]
        return argv + self.extra_args

    def environment(self, *, threads: int, admin_token: str) -> dict[str, str]:
        env = {**super().environment(threads=threads, admin_token=admin_token),
               "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
        if admin_token:  # in the environment rather than argv, which `ps` shows
            env["MILES_ADMIN_TOKEN"] = admin_token
        return env
