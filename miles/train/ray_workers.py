"""A sharded backend's worker processes: ``world_size`` Ray actors of one class, one placement-group bundle
each, called together. Each worker reserves ``cpus_per_worker`` CPUs, one GPU when training on a GPU, and
the custom resources of ``cluster.train_resources`` (the runner sets the backend's ``ray_resources``).

Workers run collectives, so a failure of one stops them all: a peer left waiting in a collective would
hang the run. ``miles-fsdp2`` and ``miles-megatron`` use this through :mod:`miles.train.api`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from miles.cluster import describe_capacity
from miles.errors import ConfigError, RunError

__all__ = ["RayWorkers", "RayWorkersBackend"]


class RayWorkers:
    def __init__(self, name: str, world_size: int, cpus_per_worker: float, startup_timeout_s: float) -> None:
        self.name, self.world_size, self.cpus_per_worker = name, world_size, cpus_per_worker
        self.startup_timeout_s = startup_timeout_s
        self.actors: list[Any] = []
        self._group: Any = None

    @property
    def ray_cpus(self) -> float:
        return self.world_size * self.cpus_per_worker

    def start(self, worker_cls: type, device: str, resources: dict[str, float],
              args: Callable[[int], tuple]) -> None:
        """Place the workers (or fail at once, saying what was asked and what the cluster has) and create
        them: worker ``rank`` is ``worker_cls(*args(rank))``."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            raise RunError(f"backend {self.name} runs its workers on Ray: start Miles through `miles train` "
                           f"(which starts or joins the cluster) or call ray.init() first")
        self.shutdown()
        total = ray.cluster_resources()
        on_gpu = device == "cuda" or (device == "auto" and total.get("GPU", 0) > 0)
        bundle = {"CPU": self.cpus_per_worker, **({"GPU": 1.0} if on_gpu else {}), **resources}
        for resource, each in bundle.items():
            asked = each * self.world_size
            if asked > total.get(resource, 0):
                raise ConfigError(
                    f"backend: {self.name} with world_size={self.world_size} needs {asked:g} {resource} "
                    f"({each:g} per worker); the Ray cluster has {total.get(resource, 0):g} {resource}. Lower "
                    f"backend.world_size or backend.cpus_per_worker, or give Ray more (cluster.num_cpus, more "
                    f"nodes, or nodes with the resources of cluster.train_resources).")
        self._group = placement_group([dict(bundle) for _ in range(self.world_size)], strategy="PACK")
        if not self._group.wait(self.startup_timeout_s):
            remove_placement_group(self._group)
            self._group = None
            raise RunError(f"backend: could not place {self.world_size} {self.name} workers ({bundle} each) within "
                           f"{self.startup_timeout_s:g} s: {describe_capacity(ray, bundle)}")
        actor = ray.remote(worker_cls)
        custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
        self.actors = [
            actor.options(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), resources=custom,
                          scheduling_strategy=PlacementGroupSchedulingStrategy(self._group,
                                                                               placement_group_bundle_index=rank))
            .remote(*args(rank))
            for rank in range(self.world_size)
        ]

    def gather(self, refs: list[Any], what: str) -> list[Any]:
        """Results in order. The first failure stops every worker; a worker's ConfigError stays one (exit 2)."""
        import ray

        pending, done = list(refs), {}
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                done[ready[0]] = ray.get(ready[0])
            except ray.exceptions.RayActorError as exc:
                self.shutdown(graceful=False)
                raise RunError(f"{self.name} worker {refs.index(ready[0])} died during {what}: {exc}. "
                               f"The last checkpoint is untouched.") from exc
            except ray.exceptions.RayTaskError as exc:
                self.shutdown(graceful=False)
                if isinstance(exc.as_instanceof_cause(), ConfigError):
                    raise ConfigError(str(exc.as_instanceof_cause()).splitlines()[-1]) from exc
                raise RunError(f"{self.name} worker {refs.index(ready[0])} failed during {what}: {exc}") from exc
        return [done[ref] for ref in refs]

    def call(self, method: str, *args: Any, per_rank: list[tuple] | None = None) -> list[Any]:
        """``method`` on every worker (``per_rank[rank]`` first, then ``args``); their results in rank order."""
        if not self.actors:
            raise RunError(f"the {self.name} workers are not running (call setup first); cannot run {method}")
        refs = [getattr(w, method).remote(*(per_rank[rank] if per_rank else ()), *args)
                for rank, w in enumerate(self.actors)]
        return self.gather(refs, method)

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the workers and release their placement group (safe to call twice). After a failure the peers
        of a dead worker may be stuck in a collective, so they are killed without asking."""
        import ray
        from ray.util.placement_group import remove_placement_group

        actors, self.actors = self.actors, []
        if graceful and actors:
            try:
                ray.get([actor.shutdown.remote() for actor in actors], timeout=30)
            except Exception:  # noqa: BLE001 - dead or stuck: killed below
                pass
        for actor in actors:
            ray.kill(actor)
        if self._group is not None:
            remove_placement_group(self._group)
            self._group = None


class RayWorkersBackend:
    """What a backend whose workers are a :class:`RayWorkers` group shares: it sets ``self.group`` in its
    constructor; the runner sets ``ray_resources`` (``cluster.train_resources``) before ``setup``."""

    uses_ray = True
    group: RayWorkers
    ray_resources: dict[str, float] = {}  # replaced, never mutated

    @property
    def ray_cpus(self) -> float:
        """Logical CPUs the workers reserve on Ray (checked against ``cluster.num_cpus`` before a run starts)."""
        return self.group.ray_cpus

    @property
    def workers(self) -> list[Any]:
        return self.group.actors

    def _all(self, method: str, *args: Any, per_rank: list[tuple] | None = None) -> list[Any]:
        return self.group.call(method, *args, per_rank=per_rank)

    def shutdown(self, graceful: bool = True) -> None:
        self.group.shutdown(graceful)
