"""Process groups: the torch.distributed world (gloo on CPU, NCCL on GPU) and megatron-core's
model-parallel groups inside it."""

from __future__ import annotations

import torch
import torch.distributed as dist

from miles.train.api import RendezvousHost, join_world
from miles_megatron import cpu_shims
from miles_megatron.model import Parallel

__all__ = ["init_world", "init_model_parallel", "shutdown"]


def init_world(rank: int, world_size: int, master: tuple[str, int] | None = None, timeout_s: float = 600.0,
               device: torch.device = torch.device("cpu"), rendezvous: RendezvousHost | None = None) -> None:
    """Join the process group at ``master`` (rank 0 passes the rendezvous it hosts; a one-process world on
    127.0.0.1 when ``master`` is None)."""
    if dist.is_initialized():
        return
    if master is None:
        rendezvous = rendezvous or RendezvousHost("127.0.0.1", world_size, timeout_s)
        master = rendezvous.address
    join_world(rank, world_size, master, timeout_s, device, rendezvous)


def init_model_parallel(parallel: Parallel, seed: int) -> None:
    """megatron-core's tensor/pipeline/context/expert-parallel groups, then its RNG streams."""
    from megatron.core import parallel_state as ps

    cpu_shims.apply()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp, pipeline_model_parallel_size=parallel.pp,
        context_parallel_size=parallel.cp, expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=1, create_gloo_process_groups=False,
    )
    cpu_shims.seed_rng_streams(seed)


def shutdown() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
