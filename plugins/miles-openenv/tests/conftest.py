import functools
import json
import multiprocessing
import os
import signal
import socket
import urllib.request
from collections.abc import Callable
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from miles.testing import chat_model_dir  # noqa: E402,F401  (the fixture EnvConformance uses)
from openenv_serve import serve, environment_app  # noqa: E402

torch.set_num_threads(1)


class OpenEnvServer:
    """A real OpenEnv server (``make_app()``: by default a test environment's ``create_app``) under uvicorn in a
    child process, on 127.0.0.1 (``port`` 0: a free one). The socket is bound and listening before the child
    starts, so connections wait for it; the child is forked from this process, which imported OpenEnv already."""

    def __init__(self, make_app: Callable[[], Any] = environment_app, port: int = 0) -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted server takes its old port
            sock.bind(("127.0.0.1", port))
            sock.listen(128)
            self.port = sock.getsockname()[1]
            self.process = multiprocessing.get_context("fork").Process(
                target=serve, args=(sock, make_app), name=f"openenv-server-{self.port}", daemon=True)
            self.process.start()
        # this process's copy of the socket is closed: once the child is gone, connecting is refused
        self.url = f"http://127.0.0.1:{self.port}"

    def live(self) -> int:
        """Environments the server made and has not closed yet."""
        with urllib.request.urlopen(f"{self.url}/live", timeout=30) as answer:
            return json.load(answer)["live"]

    def kill(self) -> None:
        """Die at once (SIGKILL), as a crashed server does."""
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(timeout=60)

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=30)
            if self.process.is_alive():
                self.kill()


@pytest.fixture(scope="session")
def start_server():
    """Start OpenEnv servers of test environment ``env`` (``start_server(env, env_args, port)``), or of any
    app (``start_server(make_app=...)``); every one is stopped at the end."""
    servers = []

    def start(env: str = "countdown", env_args: dict | None = None, port: int = 0,
              make_app: Callable[[], Any] | None = None) -> OpenEnvServer:
        servers.append(OpenEnvServer(make_app or functools.partial(environment_app, env, env_args), port))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def countdown_server(start_server) -> OpenEnvServer:
    """One server shared by the checks that keep it alive."""
    return start_server()


@pytest.fixture(scope="session")
def add_up_server(start_server) -> OpenEnvServer:
    """A server of the MCP test environment."""
    return start_server("add_up")
