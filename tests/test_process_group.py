"""The training world's rendezvous: rank 0's port is bound from the moment its address exists (a port probed free
and bound later was taken in between in CI: EADDRINUSE), and ranks in other processes join it."""

from __future__ import annotations

import errno
import multiprocessing as mp
import socket

import pytest
import torch

from miles.train.api import RendezvousHost, join_world


def test_the_address_handed_out_is_already_bound() -> None:
    host = RendezvousHost("127.0.0.1", world_size=2, timeout_s=30)
    with socket.socket() as probe, pytest.raises(OSError) as err:
        probe.bind(host.address)
    assert err.value.errno == errno.EADDRINUSE


def test_a_rank_must_host_the_address_it_joins() -> None:
    host = RendezvousHost("127.0.0.1", world_size=2, timeout_s=30)
    with pytest.raises(ValueError, match="hosts the rendezvous at"):
        join_world(0, 2, ("127.0.0.1", host.address[1] + 1), 30, torch.device("cpu"), host)


def _rank(rank: int, address: tuple[str, int], out: mp.Queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    join_world(rank, 2, address, 60, torch.device("cpu"))
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    out.put((rank, value.item()))
    dist.destroy_process_group()


def test_ranks_in_other_processes_join_rank_0s_world() -> None:
    import torch.distributed as dist

    host = RendezvousHost("127.0.0.1", world_size=2, timeout_s=60)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    other = ctx.Process(target=_rank, args=(1, host.address, out))
    other.start()
    try:
        join_world(0, 2, host.address, 60, torch.device("cpu"), host)
        value = torch.tensor([1.0])
        dist.all_reduce(value)
        assert value.item() == 3.0
        assert out.get(timeout=60) == (1, 3.0)
        join_world(0, 2, host.address, 60, torch.device("cpu"), host)  # already a member: nothing happens
        assert dist.get_world_size() == 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        other.join(timeout=60)
    assert other.exitcode == 0
