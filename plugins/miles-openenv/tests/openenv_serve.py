"""OpenEnv servers for the tests: the test environments behind OpenEnv's ``create_app`` under uvicorn, the way
an OpenEnv environment's ``server/app.py`` serves one. The tests run :func:`serve` in a forked child process
on a socket they bound.

The test environments' apps have one more route, for the tests: ``GET /live``, the environments the server
has not closed.
"""

from __future__ import annotations

import asyncio
import functools
import socket
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI
from openenv.core.env_server import CallToolAction, CallToolObservation, create_app

from openenv_testenvs import AddUp, CountAction, CountObservation, Countdown

ENVIRONMENTS = {"countdown": (Countdown, CountAction, CountObservation),
                "add_up": (AddUp, CallToolAction, CallToolObservation)}


def environment_app(env: str = "countdown", env_args: dict[str, Any] | None = None) -> FastAPI:
    """The app of test environment ``env`` (made with ``env_args``), with ``GET /live``."""
    env_cls, action_cls, observation_cls = ENVIRONMENTS[env]
    app = create_app(functools.partial(env_cls, **(env_args or {})), action_cls, observation_cls, env_name=env,
                     max_concurrent_envs=64)
    app.get("/live")(lambda: {"live": env_cls.live})
    return app


def serve(sock: socket.socket, make_app: Callable[[], FastAPI]) -> None:
    """Serve ``make_app()`` on ``sock``, which listens already, until SIGTERM."""
    server = uvicorn.Server(uvicorn.Config(make_app(), log_level="warning"))
    asyncio.run(server.serve(sockets=[sock]))
