"""What megatron-core needs to run on a machine without CUDA, applied only there.

megatron-core 0.16 asks ``torch.cuda.current_device()`` for the device of tensors it creates during
the forward pass (rotary frequencies, gather buffers, MoE routing scratch), calls
``torch.cuda.synchronize()`` after staging a distributed checkpoint's tensors
(``dist_checkpointing/strategies/filesystem_async.py``), and keeps its dropout RNG streams
(tensor-parallel, data-parallel, expert-parallel) as CUDA generator states. Without CUDA,
:func:`apply` makes ``torch.cuda.current_device`` answer ``"cpu"`` and ``torch.cuda.synchronize``
do nothing (there is no device to wait for), and :func:`seed_rng_streams` installs a tracker that
keeps those streams as CPU generator states. Both do nothing when CUDA is
available.

One more patch applies wherever Transformer Engine is missing (CPU or GPU): megatron-core 0.16.1's
``transformer/moe/moe_utils.py`` imports ``te_general_gemm`` only when Transformer Engine imports,
then tests ``te_general_gemm is not None`` in the MoE router (``NameError`` without it);
:func:`apply` defines it as None there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["apply", "applied", "seed_rng_streams", "CpuRNGStatesTracker"]

_APPLIED = False


def applied() -> bool:
    return _APPLIED


def _define_missing_te_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def apply() -> None:
    """Patch this process for megatron-core (idempotent; the CUDA shims only when CUDA is missing)."""
    global _APPLIED
    _define_missing_te_gemm()
    if _APPLIED or torch.cuda.is_available():
        return
    torch.cuda.current_device = lambda: "cpu"  # used as a `device=` argument throughout megatron-core
    torch.cuda.synchronize = lambda device=None: None
    _APPLIED = True


class CpuRNGStatesTracker:
    """megatron-core's named RNG streams (``get_cuda_rng_tracker()``), kept as CPU generator states.

    ``fork(name)`` runs its body on stream ``name`` and then restores the default CPU stream, the way
    megatron's CUDA tracker does for CUDA streams.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_ or name in self.states_:
            raise ValueError(f"RNG stream {name!r} (seed {seed}) is already tracked")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"RNG stream {name!r} was never seeded (seed_rng_streams)")
        default = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(default)


def seed_rng_streams(seed: int) -> None:
    """Seed megatron-core's RNG streams for this rank (after ``parallel_state`` is initialised):
    ``model_parallel_cuda_manual_seed`` on CUDA, the same streams and seeds on the CPU tracker otherwise."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mp_random

    if torch.cuda.is_available():
        mp_random.model_parallel_cuda_manual_seed(seed)
        return
    tracker = CpuRNGStatesTracker()
    mp_random._CUDA_RNG_STATE_TRACKER = tracker  # megatron-core has no public setter for the tracker
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    tracker.add(mp_random.get_data_parallel_rng_tracker_name(), seed)
    tracker.add("model-parallel-rng", seed + 2718 + ps.get_tensor_model_parallel_rank())
    tracker.add(mp_random.get_expert_parallel_rng_tracker_name(),
                seed + 1024 + 100 * ps.get_expert_model_parallel_rank() + ps.get_expert_tensor_parallel_rank())
