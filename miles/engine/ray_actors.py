"""Engines as Ray actors, each serving SGLang's protocol over HTTP, restarted by Ray if they die.

The router finds a restarted engine through its actor (``resolve``); an actor that Ray will not
restart (killed with ``no_restart``, or out of restarts) is an engine gone for good.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import sys
import threading
import time
from typing import Any

from miles.cluster import dead_node, describe_capacity, describe_nodes
from miles.errors import RunError
from miles.engine.router import EngineGone, Router
from miles.ports import free_port

__all__ = ["EngineActor", "engine_meta", "launch_engines", "resolver", "shutdown_engines", "start_actors"]

log = logging.getLogger(__name__)


class EngineActor:
    """Starts its engine server with a launcher (:mod:`miles.engine.launchers`) from a supervisor thread
    that lives as long as the actor; ``address`` answers once the server is up. When the server's process
    dies, the actor exits, and Ray restarts it (which starts a new server); when the actor dies, its server
    is killed with it (the launcher's parent-death signal is tied to the supervisor thread)."""

    def __init__(self, launcher: Any, model_path: str, host: str, admin_token: str, threads: int,
                 startup_timeout_s: float = 600.0) -> None:
        import queue

        self.launcher = launcher
        self.port = free_port(host)
        started: queue.Queue = queue.Queue()

        def supervise() -> None:
            try:
                url = launcher.start(model_path, host=host, port=self.port, admin_token=admin_token, threads=threads,
                                     timeout_s=startup_timeout_s)
            except BaseException as exc:  # noqa: BLE001 - handed to __init__, which raises it
                started.put(exc)
                return
            started.put(url)
            while launcher.alive():
                time.sleep(0.2)
            print(f"miles: the engine server at {url} stopped; this engine actor exits (Ray restarts it): "
                  f"{launcher.describe()}", file=sys.stderr, flush=True)
            os._exit(1)

        threading.Thread(target=supervise, name="miles-engine-supervisor", daemon=True).start()
        result = started.get()
        if isinstance(result, BaseException):
            raise result
        self.url = result

    def address(self) -> str:
        return self.url

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        """The Ray node this actor runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def describe(self) -> dict[str, Any]:
        """The launcher's description: ``protocol``, ``tp_size``, the server's ``pid`` and ``log``."""
        return self.launcher.describe()


def launch_engines(ray: Any, count: int, model_path: str, launcher: Any, *, cpus_per_engine: float,
                   multi_node: bool, startup_timeout_s: float, router_args: dict[str, Any],
                   resources: dict[str, float] | None = None) -> tuple[Router, list[Any], Any, Any]:
    """Start ``count`` engine actors in a placement group; returns the router, the actors, the group, and how to
    start more (``start(count)``: :class:`miles.engine.ray_fleet.RayFleet`).
    Each reserves ``cpus_per_engine`` CPUs and the custom ``resources`` (placing it on the nodes that have them)."""
    host = ray.util.get_node_ip_address() if multi_node else "127.0.0.1"
    token = secrets.token_hex(16) if multi_node else ""

    def start(n: int, placement_timeout_s: float | None = None) -> tuple[list[str], list[Any], list[str], Any,
                                                                        dict[str, float]]:
        return start_actors(ray, n, model_path, launcher, host=host, token=token, cpus_per_engine=cpus_per_engine,
                            startup_timeout_s=startup_timeout_s, resources=resources,
                            placement_timeout_s=placement_timeout_s)

    urls, actors, nodes, group, bundle = start(count)
    router = Router(urls, admin_token=token, **router_args)
    print(f"rollout.engine: {count} engine(s) on Ray node(s) {describe_nodes(ray, nodes)}", file=sys.stderr)
    for endpoint, actor, node in zip(router.engines, actors, nodes):
        endpoint.meta.update(actor=actor, node=node, **engine_meta(launcher))
        endpoint.resolve = resolver(ray, router, endpoint, bundle)
    return router, actors, group, start


def engine_meta(launcher: Any) -> dict[str, Any]:
    """What the weight transports may send an engine of ``launcher`` (miles-sglang: no safetensors tensors, tp ranks
    per engine)."""
    return {"protocol": getattr(launcher, "protocol", "miles"), "tp_size": getattr(launcher, "tp_size", 1)}


def start_actors(ray: Any, count: int, model_path: str, launcher: Any, *, host: str, token: str,
                 cpus_per_engine: float, startup_timeout_s: float, resources: dict[str, float] | None,
                 placement_timeout_s: float | None = None) -> tuple[list[str], list[Any], list[str], Any,
                                                                     dict[str, float]]:
    """``count`` engine actors in a placement group of their own, serving: their URLs, actors, Ray nodes, the
    group, and one engine's bundle. The group waits ``placement_timeout_s`` for room (default: the start-up's)."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    resources = dict(resources or {})
    gpus = float(getattr(launcher, "gpus", 0.0))  # an SGLang server: its tensor-parallel size
    bundle = {"CPU": cpus_per_engine, **({"GPU": gpus} if gpus else {}), **resources}
    group = placement_group([dict(bundle) for _ in range(count)], strategy="PACK")
    placement_timeout_s = startup_timeout_s if placement_timeout_s is None else placement_timeout_s
    if not group.wait(placement_timeout_s):
        remove_placement_group(group)
        raise RunError(f"could not place {count} engine(s) of {bundle} each within {placement_timeout_s:g} s "
                       f"(cluster.cpus_per_engine, cluster.engine_resources); {describe_capacity(ray, bundle)}")
    remote = ray.remote(EngineActor)
    actors = [
        remote.options(num_cpus=cpus_per_engine, num_gpus=gpus, resources=resources, max_restarts=-1,
                       max_task_retries=-1, max_concurrency=4,
                       scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i))
        .remote(launcher, model_path, host, token, max(1, int(cpus_per_engine)), startup_timeout_s)
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
    nodes = ray.get([a.node_id.remote() for a in actors])
    return urls, actors, nodes, group, bundle


def resolver(ray: Any, router: Router, endpoint: Any, bundle: dict[str, float]):
    """The engine's address, from its actor: a restarted actor answers with its new one. An engine whose
    Ray node died is reported once, naming the node: while it waits to be re-placed where there is room
    (with what each live node has), or, when Ray re-placed it before it was looked up, with its new node."""
    from ray.exceptions import ActorDiedError

    actor = endpoint.meta["actor"]

    async def report_lost(now_on: str | None) -> None:
        node = endpoint.meta["node"]
        lost = await asyncio.to_thread(dead_node, ray, node)
        if lost is None or endpoint.meta.get("reported_node") == node:
            return
        endpoint.meta["reported_node"] = node
        router.stats["engines_lost_with_node"] += 1
        if now_on is None:
            capacity = await asyncio.to_thread(describe_capacity, ray, bundle)
            where = f"Ray re-places the engine when a live node has room for {bundle}: {capacity}"
        else:
            new_node = await asyncio.to_thread(describe_nodes, ray, [now_on])
            where = f"Ray re-placed the engine ({bundle}) on node {new_node}"
        log.warning("miles: %s was on Ray node %s, which is gone (its raylet stopped); %s", router.name(endpoint),
                    lost, where)

    async def resolve() -> str:
        try:  # while Ray restarts the actor, the call waits for the new one
            url = await asyncio.wait_for(actor.address.remote(), timeout=5)
        except ActorDiedError as exc:
            raise EngineGone("its Ray actor died and will not be restarted") from exc
        except asyncio.TimeoutError:
            await report_lost(None)
            raise
        node = await actor.node_id.remote()
        if node != endpoint.meta["node"]:  # restarted elsewhere
            await report_lost(node)
            endpoint.meta["node"] = node
        return url

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

