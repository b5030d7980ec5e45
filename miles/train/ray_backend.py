"""The training plane as a Ray actor: the configured backend runs in its own process, placed in a
placement-group bundle, and the loop drives it through a proxy with the same contract."""

from __future__ import annotations

import sys
from typing import Any

from miles.errors import RunError
from miles.train.backend import BackendProxy

__all__ = ["BackendHost", "RemoteBackend", "launch_backend"]


class BackendHost:
    """Holds a backend inside the actor and runs its methods."""

    def __init__(self, backend: Any, threads: int) -> None:
        import torch

        torch.set_num_threads(threads)
        self.backend = backend

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.backend, method)(*args, **kwargs)


class RemoteBackend(BackendProxy):
    """The driver's view of a backend in an actor (the :class:`miles.train.TrainBackend` contract)."""

    def __init__(self, ray: Any, actor: Any, group: Any) -> None:
        self._ray, self._actor, self._group = ray, actor, group

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self._actor is None:
            raise RunError(f"the training worker was shut down; cannot run {method}")
        try:
            return self._ray.get(self._actor.call.remote(method, *args, **kwargs))
        except self._ray.exceptions.RayActorError as exc:
            raise RunError(f"the training worker died during {method}: {exc}. "
                           f"The last checkpoint is untouched.") from exc

    def shutdown(self) -> None:
        """Shut the backend down and release its actor (once; later calls do nothing)."""
        from ray.util.placement_group import remove_placement_group

        if self._actor is None:
            return
        actor, self._actor = self._actor, None
        try:
            self._ray.get(actor.call.remote("shutdown"))
        except self._ray.exceptions.RayActorError:
            pass  # already gone
        finally:
            self._ray.kill(actor)
            remove_placement_group(self._group)


def launch_backend(ray: Any, backend: Any, *, cpus: float, startup_timeout_s: float,
                   resources: dict[str, float] | None = None) -> RemoteBackend:
    """Ship ``backend`` to an actor reserving ``cpus`` CPUs and the custom ``resources`` (cluster.train_resources)."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from miles.cluster import describe_capacity
    from miles.cluster import describe_nodes

    resources = dict(resources or {})
    bundle = {"CPU": cpus, **resources}
    group = placement_group([bundle], strategy="PACK")
    if not group.wait(startup_timeout_s):
        remove_placement_group(group)
        raise RunError(f"could not place the training worker ({bundle}) within {startup_timeout_s} s "
                       f"(cluster.train_cpus, cluster.train_resources); {describe_capacity(ray, bundle)}")
    actor = ray.remote(BackendHost).options(
        num_cpus=cpus, resources=resources,
        scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0),
    ).remote(backend, max(1, int(cpus)))
    node = ray.get(actor.node_id.remote(), timeout=startup_timeout_s)
    print(f"backend: the training worker on Ray node {describe_nodes(ray, [node])}", file=sys.stderr)
    return RemoteBackend(ray, actor, group)
