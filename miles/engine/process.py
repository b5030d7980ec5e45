"""The embedded engine in a process of its own, beside the trainer, without Ray.

Why: under a streaming schedule (``run.schedule`` one_step_off or async) generation and training are meant to
overlap. An engine in the trainer's process generates in a thread that shares the interpreter lock with
training: each waits for the other, and the step was measured at 0.6-0.74x the synchronous one. In a process of
its own (``miles engine serve`` on 127.0.0.1, driven over HTTP through the router like any remote engine) it has
a core to itself. ``rollout.engine.separate_process`` chooses: ``auto`` does this for a streaming schedule when
the machine has two cores or more and the trainer keeps this process (by default the trainer moves out instead:
``backend.separate_process``, :mod:`miles.train.process_backend`), ``true`` always (any schedule), ``false`` never.

The server is a child of the trainer: it dies with it (parent-death signal), and the run stops it at its end.
One that dies during the run is started again, as Ray restarts an engine actor, and caught up with the
current weights before it serves.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from miles.cluster import cores
from miles.engine.launchers import MilesServerLauncher
from miles.engine.router import EngineGone, Router
from miles.errors import RunError
from miles.ports import free_port

__all__ = ["separate_process", "start_engine_process"]

log = logging.getLogger(__name__)


def separate_process(setting: str | bool, *, engine: str, streaming: bool,
                     trainer_apart: bool = False) -> tuple[bool, str | None]:
    """Whether the in-process engine (``num_engines: 0``) ``engine`` is served from a process of its own, and a
    line to print at start when a streaming schedule keeps it and the trainer in this process (its steps cannot
    overlap). ``trainer_apart``: the trainer has a process of its own (``backend.separate_process``), which
    ``auto`` prefers: the engine then generates here, without HTTP between it and the rollouts."""
    if setting is True or (setting == "auto" and streaming and engine == "local" and cores() >= 2
                           and not trainer_apart):
        return True, None
    if not streaming or trainer_apart:
        return False, None
    why = ("rollout.engine.separate_process=false, and the trainer runs here too" if setting is False else
           f"rollout.engine {engine!r} runs in this process" if engine != "local" else
           f"this machine gives the run {cores()} core")
    return False, (f"the rollout cannot overlap training: the engine generates in this process ({why}), in a "
                   f"thread that shares the interpreter with training, so each step waits for both. Overlap needs "
                   f"backend.separate_process or rollout.engine.separate_process (auto: on 2 cores or more) or "
                   f"rollout.engine.num_engines >= 1")


def start_engine_process(model_path: str, engine_args: dict[str, Any], *, threads: int, startup_timeout_s: float,
                         router_args: dict[str, Any]) -> tuple[Router, MilesServerLauncher]:
    """Start ``miles engine serve`` with the builtin engine's arguments (``engine_args``, without ``name``) on a
    free port of 127.0.0.1; returns a router over it (not started) and the launcher (``stop`` ends the server).

    A server that dies is started again when the router looks for it (its endpoint's ``resolve``), on a new port,
    and caught up by the router's ``on_readmit``; one that cannot start again is gone, and the run stops."""
    args = {k: v for k, v in engine_args.items() if k != "name"}
    launcher = MilesServerLauncher(seed=int(args.pop("seed", 0)), extra_args=["--engine-args", json.dumps(args)],
                                   startup_timeout_s=startup_timeout_s)

    def start() -> str:
        return launcher.start(model_path, host="127.0.0.1", port=free_port(), admin_token="", threads=threads,
                              timeout_s=startup_timeout_s)

    router = Router([start()], **router_args)
    endpoint = router.engines[0]
    endpoint.meta.update(protocol=launcher.protocol, tp_size=1)

    async def resolve() -> str:
        if launcher.alive():  # it failed health checks but runs: the same server
            return endpoint.url
        log.warning("miles: the engine's process (%s) exited; starting it again", launcher.log_path)
        try:
            return await asyncio.to_thread(start)
        except RunError as exc:
            raise EngineGone(f"its process exited and could not start again: {exc}") from exc

    endpoint.resolve = resolve
    return router, launcher
