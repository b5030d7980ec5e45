"""A run's Ray engines as a fleet that grows and shrinks between steps (an elastic fleet).

``miles fleet RUN_DIR --engines N`` writes the wanted count to ``RUN_DIR/fleet.json``; the run reads it before
each step (:meth:`RayFleet.follow`). New engine actors start in a placement group of their own and join through
:meth:`Router.add_engine`: quarantined until the weight transport has caught them up (``on_readmit``), then in
service. Engines that leave go through :meth:`Router.remove_engine` (no new request, what they hold finishes there),
then their actors are killed for good and their placement group removed. The engines the run started with leave
last (newest first).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from miles.engine.router import EngineEndpoint, Router
from miles.errors import ConfigError, RunError

__all__ = ["FLEET_FILE", "RayFleet", "request_engines"]

FLEET_FILE = "fleet.json"
PLACEMENT_TIMEOUT_S = 30.0  # a fleet request the cluster has no room for holds the run this long, then is dropped


def request_engines(run_dir: str | Path, engines: int) -> Path:
    """Ask the run in ``run_dir`` for ``engines`` engines (read before its next step)."""
    if engines < 1:
        raise ConfigError(f"--engines must be at least 1 (a run needs an engine), got {engines}")
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"{run_dir} is not a Miles run directory (it has no config.yaml)")
    config = OmegaConf.load(run_dir / "config.yaml")
    num_engines = OmegaConf.select(config, "rollout.engine.num_engines", default=0)
    if not num_engines or OmegaConf.select(config, "cluster.local_mode", default=False):
        raise ConfigError(f"the run in {run_dir} has its engine in process (rollout.engine.num_engines={num_engines}"
                          f"{', cluster.local_mode' if num_engines else ''}): only engines on Ray "
                          "(rollout.engine.num_engines >= 1) join and leave a running fleet")
    path = run_dir / FLEET_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"engines": engines}))
    tmp.replace(path)  # the run never reads half a request
    return path


@dataclass
class RayFleet:
    """What a new engine actor needs (those of :func:`miles.engine.ray_actors.launch_engines`), the router, and
    each added engine's placement group."""

    ray: Any
    router: Router
    plane: Any  # the rollout plane: the router's calls run on its loop
    start: Any  # start(count) -> (urls, actors, nodes, group, bundle): new engine actors in a group of their own
    meta: dict[str, Any]  # what every engine's endpoint says of it (miles.engine.ray_actors.engine_meta)
    groups: dict[str, Any] = field(default_factory=dict)  # url -> the placement group of an added engine
    added: list[EngineEndpoint] = field(default_factory=list)  # newest last
    seen: float | None = None  # the request file's mtime last applied

    @property
    def in_service_or_joining(self) -> list[EngineEndpoint]:
        return [e for e in self.router.engines if not e.gone]

    def follow(self, run_dir: Path) -> None:
        """Apply ``run_dir/fleet.json`` if it changed since the last look."""
        path = run_dir / FLEET_FILE
        try:
            stamp = path.stat().st_mtime
        except FileNotFoundError:
            return
        if stamp == self.seen:
            return
        self.seen = stamp
        try:
            wanted = int(json.loads(path.read_text())["engines"])
        except (ValueError, KeyError, TypeError) as exc:
            print(f"miles: {path} is not a fleet request ({type(exc).__name__}: {exc}); expected "
                  '{"engines": N} as `miles fleet RUN_DIR --engines N` writes it; ignored', file=sys.stderr)
            return
        self.scale_to(wanted)

    def scale_to(self, wanted: int) -> None:
        wanted = max(1, wanted)
        have = len(self.in_service_or_joining)
        if wanted > have:
            self.add(wanted - have)
        elif wanted < have:
            self.remove(have - wanted)

    def add(self, count: int) -> list[EngineEndpoint]:
        """``count`` engines join: started now, in service once caught up (the router's next health checks)."""
        from miles.engine.ray_actors import resolver

        try:
            urls, actors, nodes, group, bundle = self.start(count, placement_timeout_s=PLACEMENT_TIMEOUT_S)
        except RunError as exc:  # the cluster has no room now: the run goes on with the engines it has
            print(f"miles: fleet: {count} engine(s) could not join: {exc}", file=sys.stderr)
            return []
        joined = []
        for url, actor, node in zip(urls, actors, nodes):
            endpoint = self.plane.run(_add(self.router, url))
            endpoint.meta.update(actor=actor, node=node, **self.meta)
            endpoint.resolve = resolver(self.ray, self.router, endpoint, bundle)
            self.groups[endpoint.url] = group
            joined.append(endpoint)
        self.added += joined
        print(f"miles: fleet: {count} engine(s) joining ({', '.join(urls)}); "
              f"{len(self.in_service_or_joining)} engine(s) now", file=sys.stderr)
        return joined

    def remove(self, count: int) -> None:
        """``count`` engines leave, the newest first: drained, then their actors killed."""
        from ray.util.placement_group import remove_placement_group

        live = self.in_service_or_joining
        newest_first = [e for e in reversed(self.added) if not e.gone] + [e for e in reversed(live)
                                                                          if e not in self.added]
        leaving = newest_first[:min(count, len(live) - 1)]
        for endpoint in leaving:
            self.plane.run(self.router.remove_engine(endpoint))
            try:
                self.ray.kill(endpoint.meta["actor"], no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
            group = self.groups.pop(endpoint.url, None)
            if group is not None and not any(g is group for g in self.groups.values()):
                remove_placement_group(group)
        print(f"miles: fleet: {len(leaving)} engine(s) left ({', '.join(e.url for e in leaving)}); "
              f"{len(self.in_service_or_joining)} engine(s) now", file=sys.stderr)

    def close(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for endpoint in self.added:
            try:
                self.ray.kill(endpoint.meta["actor"], no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        for group in {id(g): g for g in self.groups.values()}.values():
            try:
                remove_placement_group(group)
            except Exception:  # noqa: BLE001
                pass
        self.groups.clear()


async def _add(router: Router, url: str) -> EngineEndpoint:
    return router.add_engine(url)
