"""Joining a training backend's torch.distributed world without a port race.

Rank 0 hosts the rendezvous (a ``TCPStore``) on a port the OS hands it while binding, and keeps it bound until the
group is up; the other ranks join that address. Choosing a free port first and binding it later (``tcp://host:port``
with a port found by closing a probe socket) loses the port to any process that binds in between: CI saw
``EADDRINUSE`` from exactly that while Ray started workers beside it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where used: miles.train.api stays light for `miles config`
    import torch

__all__ = ["RendezvousHost", "join_world"]


class RendezvousHost:
    """The store rank 0 hosts, bound from construction: ``address`` is what the other ranks are sent."""

    def __init__(self, host: str, world_size: int, timeout_s: float = 600.0) -> None:
        import torch.distributed as dist

        self.store = dist.TCPStore(host, 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                                   wait_for_workers=False)
        self.address: tuple[str, int] = (host, self.store.port)

    @classmethod
    def on_this_ray_node(cls, world_size: int, timeout_s: float) -> RendezvousHost:
        """Hosted at this Ray node's address (a backend's rank-0 worker, inside a Ray actor)."""
        import ray

        return cls(ray.util.get_node_ip_address(), world_size, timeout_s)


def join_world(rank: int, world_size: int, address: tuple[str, int], timeout_s: float, device: torch.device,
               host: RendezvousHost | None = None) -> None:
    """Join the process group at ``address`` (rank 0 passes the :class:`RendezvousHost` it made): gloo on CPU,
    NCCL on CUDA. Nothing to do when this process already belongs to one."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    timeout = timedelta(seconds=timeout_s)
    if host is not None:
        if host.address != tuple(address):
            raise ValueError(f"rank {rank} hosts the rendezvous at {host.address}, not at {tuple(address)}")
        store = host.store
    else:
        store = dist.TCPStore(address[0], int(address[1]), world_size, is_master=False, timeout=timeout)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                            world_size=world_size, timeout=timeout)
