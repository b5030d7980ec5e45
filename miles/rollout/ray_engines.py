"""Engines as Ray actors, each serving SGLang's protocol over HTTP, restarted by Ray if they die.

The router finds a restarted engine through its actor (``resolve``); an actor that Ray will not
restart (killed with ``no_restart``, or out of restarts) is an engine gone for good.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import threading
from typing import Any

from miles.errors import RunError
from miles.rollout.router import EngineGone, Router

__all__ = ["EngineActor", "launch_engines", "shutdown_engines"]


class EngineActor:
    """Loads the model and serves it in a thread of its own; ``address`` answers once it is up."""

    def __init__(self, model_path: str, engine_args: dict[str, Any], host: str, admin_token: str, threads: int) -> None:
        import torch
        from aiohttp import web

        from miles.engine.local import LocalEngine
        from miles.engine.server import build_app

        torch.set_num_threads(threads)
        self.engine = LocalEngine(**{**engine_args, "background": True})
        self.engine.load_model(model_path)
        with socket.socket() as s:
            s.bind((host, 0))
            self.port = s.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        loop = asyncio.new_event_loop()
        runner = web.AppRunner(build_app(self.engine, admin_token))
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, host, self.port).start())
        threading.Thread(target=loop.run_forever, name="miles-engine-http", daemon=True).start()

    def address(self) -> str:
        return self.url

    def pid(self) -> int:
        return os.getpid()


def launch_engines(ray: Any, count: int, model_path: str, engine_args: dict[str, Any], *, cpus_per_engine: float,
                   multi_node: bool, startup_timeout_s: float, router_args: dict[str, Any]) -> tuple[Router, list[Any], Any]:
    """Start ``count`` engine actors in a placement group; returns the router, the actors, the group."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    host = ray.util.get_node_ip_address() if multi_node else "127.0.0.1"
    token = secrets.token_hex(16) if multi_node else ""
    group = placement_group([{"CPU": cpus_per_engine}] * count, strategy="PACK")
    if not group.wait(startup_timeout_s):
        remove_placement_group(group)
        raise RunError(f"could not place {count} engine(s) of {cpus_per_engine} CPU each within {startup_timeout_s} s; "
                       f"the cluster has {ray.cluster_resources().get('CPU', 0)} CPUs")
    remote = ray.remote(EngineActor)
    actors = [
        remote.options(num_cpus=cpus_per_engine, max_restarts=-1, max_task_retries=-1, max_concurrency=4,
                       scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i))
        .remote(model_path, engine_args, host, token, max(1, int(cpus_per_engine)))
        for i in range(count)
    ]
    try:
        urls = ray.get([a.address.remote() for a in actors], timeout=startup_timeout_s)
    except Exception as exc:
        for a in actors:
            ray.kill(a)
        remove_placement_group(group)
        raise RunError(f"engines did not start within {startup_timeout_s} s (cluster.engine_startup_timeout_s): "
                       f"{type(exc).__name__}: {exc}") from exc
    router = Router(urls, admin_token=token, **router_args)
    for endpoint, actor in zip(router.engines, actors):
        endpoint.resolve = _resolver(actor)
        endpoint.meta["actor"] = actor
    return router, actors, group


def _resolver(actor: Any):
    from ray.exceptions import ActorDiedError

    async def resolve() -> str:
        try:  # while Ray restarts the actor, the call waits for the new one
            return await asyncio.wait_for(actor.address.remote(), timeout=5)
        except ActorDiedError as exc:
            raise EngineGone("its Ray actor died and will not be restarted") from exc

    return resolve


def shutdown_engines(ray: Any, actors: list[Any], group: Any) -> None:
    from ray.util.placement_group import remove_placement_group

    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:
            pass
    try:
        remove_placement_group(group)
    except Exception:
        pass

