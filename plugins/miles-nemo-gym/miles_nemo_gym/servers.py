"""Start a NeMo Gym server from the pinned package, in the NeMo Gym venv, as a child process of this one.

    with GymServer.start("resources_servers/example_session_state_mgmt") as server:
        ...  # server.url is e.g. http://127.0.0.1:40123

The server runs ``gym_server.py`` (next to this module) with the venv's interpreter, in its own process group and
working directory, its output in ``server.log``. ``start`` returns once the server listens (it reports its URL
on a pipe) and fails with the log's tail when it exits first; ``stop`` ends the whole process group.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from miles_nemo_gym.venv import ensure_venv

__all__ = ["GymServer"]

_SCRIPT = Path(__file__).with_name("gym_server.py")


class GymServer:
    """One running NeMo Gym server; see the module's docstring."""

    def __init__(self, process: subprocess.Popen, url: str, workdir: Path) -> None:
        self.process, self.url, self.workdir = process, url, workdir

    @property
    def log(self) -> Path:
        return self.workdir / "server.log"

    @classmethod
    def start(cls, server: str, *, host: str = "127.0.0.1", port: int = 0, refs: dict[str, str] | None = None,
              config: dict[str, Any] | None = None, name: str | None = None, python: str | Path | None = None,
              workdir: str | Path | None = None, timeout_s: float = 120.0) -> "GymServer":
        """Start ``server`` (``<kind>/<type>`` in the nemo-gym package). ``refs``: config fields naming other
        servers, with their URLs (``{"model_server": "http://127.0.0.1:8002"}``); ``config``: its other config
        fields; ``python``: the interpreter (default: the NeMo Gym venv's, built if needed)."""
        python = str(python or ensure_venv())
        workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="miles-nemo-gym-"))
        workdir.mkdir(parents=True, exist_ok=True)
        command = [python, str(_SCRIPT), server, "--host", host, "--port", str(port)]
        command += ["--name", name] if name else []
        command += [a for field, url in (refs or {}).items() for a in ("--ref", f"{field}={url}")]
        command += [a for field, value in (config or {}).items() for a in ("--set", f"{field}={json.dumps(value)}")]
        with open(workdir / "server.log", "wb") as log:
            process = subprocess.Popen(command, cwd=workdir, stdout=subprocess.PIPE, stderr=log,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            url = cls._wait_for_url(process, workdir / "server.log", server, timeout_s)
        except BaseException:
            cls._end(process)
            raise
        return cls(process, url, workdir)

    @staticmethod
    def _wait_for_url(process: subprocess.Popen, log: Path, server: str, timeout_s: float) -> str:
        """The URL the server reports on its first line of stdout, once it listens."""
        assert process.stdout is not None
        line = b""
        with selectors.DefaultSelector() as selector:
            selector.register(process.stdout, selectors.EVENT_READ)
            deadline = time.monotonic() + timeout_s
            while not line.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    raise TimeoutError(f"NeMo Gym server {server} did not start within {timeout_s:g} s; "
                                       f"its log ({log}):\n{_tail(log)}")
                chunk = os.read(process.stdout.fileno(), 4096)
                if not chunk:
                    process.wait()
                    raise RuntimeError(f"NeMo Gym server {server} exited with code {process.returncode} before "
                                       f"it listened; its log ({log}):\n{_tail(log)}")
                line += chunk
        process.stdout.close()
        return json.loads(line)["url"]

    def stop(self) -> None:
        """End the server's process group (SIGTERM, then SIGKILL after 10 s)."""
        self._end(self.process)

    def kill(self) -> None:
        """End the server at once (SIGKILL), as a crash would."""
        with contextlib.suppress(ProcessLookupError):
            if self.process.poll() is None:
                os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    @staticmethod
    def _end(process: subprocess.Popen) -> None:
        with contextlib.suppress(ProcessLookupError):  # it may end by itself meanwhile
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        if process.stdout is not None and not process.stdout.closed:
            process.stdout.close()

    def __enter__(self) -> "GymServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
