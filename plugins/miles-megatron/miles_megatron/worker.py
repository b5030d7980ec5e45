"""One Megatron rank, run as a Ray actor: its share of the policy (and reference model), optimizer
and RNG streams.

Every method that touches the model is a collective: the driver calls it on all ranks at once, each
with the rows of its data-parallel rank. The per-process step is Miles' :class:`Policy` on a
:class:`~miles_megatron.model.CausalLM`, with :class:`~miles_megatron.optimizer.ParallelAdamW`
doing the data-parallel gradient sum, the model-wide norm and clipping.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch

from miles.train.api import (Policy, RendezvousHost, TrainBatch, TrainOptions, resolve_device, rng_state,
                            set_rng_state)
from miles_megatron import parallel
from miles_megatron.arch import model_spec
from miles_megatron.convert import hf_to_megatron, rule_of, shard
from miles_megatron.model import CausalLM, Parallel, build_gpt, load_shard, local_state
from miles_megatron.optimizer import ParallelAdamW

__all__ = ["MegatronPolicy", "MegatronWorker", "load_hf_state"]


def load_hf_state(model_path: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """The HF config and weights (``transformers``' in-memory names) of a model directory."""
    from miles.train.api import load_model

    model = load_model(model_path)
    return model.config, {name: tensor.detach() for name, tensor in model.state_dict().items()}


class MegatronPolicy(Policy):
    """:class:`Policy` whose gradient norms come from the parallel optimizer and whose forward passes
    can pack each micro-batch's rows into one sequence."""

    packing = False

    def _forward(self, model: torch.nn.Module, micro: TrainBatch, **kwargs: Any):
        with model.packed(micro.attention_mask.sum(dim=1) if self.packing else None):
            return super()._forward(model, micro, **kwargs)

    def train(self, batch, plan, norms, loss_fn, loss_scale: float = 1.0):
        self.optimizer.norms.clear()
        sums, _, lr = super().train(batch, plan, norms, loss_fn, loss_scale)
        return sums, list(self.optimizer.norms), lr


class MegatronWorker:
    def __init__(self, rank: int, world_size: int, sizes: Parallel, options: TrainOptions, packing: bool,
                 threads: int) -> None:
        torch.set_num_threads(threads)
        self.rank, self.world_size, self.sizes, self.options = rank, world_size, sizes, options
        self.packing = packing
        self.policy: MegatronPolicy | None = None
        self.spec: Any = None
        self.rendezvous: RendezvousHost | None = None

    def address(self, timeout_s: float) -> tuple[str, int]:
        """Rank 0 hosts the process group's rendezvous on this node, bound now; its address goes to every rank."""
        self.rendezvous = RendezvousHost.on_this_ray_node(self.world_size, timeout_s)
        return self.rendezvous.address

    def coords(self) -> dict[str, int]:
        from megatron.core import parallel_state as ps

        return {"rank": self.rank, "dp": ps.get_data_parallel_rank(), "tp": ps.get_tensor_model_parallel_rank(),
                "ep": ps.get_expert_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
                "cp": ps.get_context_parallel_rank()}

    def init_groups(self, master: tuple[str, int], seed: int, timeout_s: float) -> dict[str, int]:
        """Join the world and build megatron's model-parallel groups (which check the sizes)."""
        device = resolve_device(self.options)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        parallel.init_world(self.rank, self.world_size, master, timeout_s, device, self.rendezvous)
        parallel.init_model_parallel(self.sizes, seed)
        return self.coords()

    def _groups(self) -> dict[str, Any]:
        from megatron.core import parallel_state as ps

        return {"dp": ps.get_data_parallel_group(), "expert_dp": ps.get_expert_data_parallel_group(),
                "tp": ps.get_tensor_model_parallel_group(), "ep": ps.get_expert_model_parallel_group()}

    def _build(self, spec: Any, full: dict[str, torch.Tensor], device: torch.device) -> CausalLM:
        from megatron.core import parallel_state as ps

        gpt = build_gpt(spec, self.sizes, device)
        load_shard(gpt, shard(full, spec, tp_size=self.sizes.tp, tp_rank=ps.get_tensor_model_parallel_rank(),
                              ep_size=self.sizes.ep, ep_rank=ps.get_expert_model_parallel_rank()))
        same_shape = ps.get_expert_model_parallel_group() if self.sizes.ep > 1 else None
        return CausalLM(gpt, spec.vocab_size, same_shape)

    def setup(self, model_path: str, seed: int, ref_model_path: str | None, total_steps: int | None) -> None:
        device = resolve_device(self.options)
        config, hf = load_hf_state(model_path)
        self.spec = model_spec(config)
        torch.manual_seed(seed)
        model = self._build(self.spec, hf_to_megatron(hf, self.spec), device).train()
        ref = None
        if ref_model_path is not None:
            ref_config, ref_hf = load_hf_state(ref_model_path)
            ref_spec = model_spec(ref_config)
            ref = self._build(ref_spec, hf_to_megatron(ref_hf, ref_spec), device).eval().requires_grad_(False)
        o = self.options
        tp_summed = [p for name, p in model.gpt.named_parameters() if rule_of(name, self.spec)[0].tp_grad_sum]
        optimizer = ParallelAdamW(model.parameters(), max_grad_norm=o.max_grad_norm, groups=self._groups(),
                                  tp_summed=tp_summed, lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay)
        # Clipping happens in the optimizer, over every shard; the core's own clip is left a no-op.
        core_options = dataclasses.replace(o, max_grad_norm=0.0)
        self.policy = MegatronPolicy(model, core_options, device, ref, total_steps, optimizer)
        self.policy.packing = self.packing

    def train(self, batch: TrainBatch, plan: list[list[list[int]]], norms: list[tuple[float, float]], loss_fn: Any):
        return self.policy.train(batch, plan, norms, loss_fn)

    def logprobs(self, batch: TrainBatch, micros: list[list[int]], reference: bool) -> list[torch.Tensor]:
        return self.policy.logprobs(batch, micros, reference=reference)

    def local_weights(self) -> dict[str, torch.Tensor]:
        """This rank's parameters by Megatron name, on CPU."""
        return {name: t.detach().cpu() for name, t in local_state(self.policy.model.gpt).items()}

    # -- checkpoints ---------------------------------------------------------------------------------

    def save_checkpoint(self, path: str) -> None:
        """Weights in megatron's distributed format (``model/``, any parallel layout can read them),
        this rank's optimizer, schedule and RNG state in ``rank<k>.pt`` (the same layout must resume)."""
        from megatron.core import dist_checkpointing
        from megatron.core.tensor_parallel import random as mp_random

        (Path(path) / "model").mkdir(exist_ok=True)
        dist_checkpointing.save(self.policy.model.gpt.sharded_state_dict(), str(Path(path) / "model"))
        state = {**self.policy.state_dict(), "rng": rng_state(),
                 "rng_streams": mp_random.get_cuda_rng_tracker().get_states(),
                 "world_size": self.world_size, "sizes": dataclasses.asdict(self.sizes)}
        torch.save(state, Path(path) / f"rank{self.rank}.pt")

    def load_checkpoint(self, path: str) -> None:
        from megatron.core import dist_checkpointing
        from megatron.core.tensor_parallel import random as mp_random

        own = Path(path) / f"rank{self.rank}.pt"
        if not own.is_file():
            raise FileNotFoundError(f"{own}: the checkpoint was written by fewer workers than this run's "
                                    f"world_size={self.world_size}")
        state = torch.load(own, weights_only=False)
        if state["sizes"] != dataclasses.asdict(self.sizes) or state["world_size"] != self.world_size:
            raise ValueError(f"checkpoint {path} was written with world_size={state['world_size']} and "
                             f"{state['sizes']}; this run has world_size={self.world_size} and "
                             f"{dataclasses.asdict(self.sizes)} (the optimizer state is per rank)")
        gpt = self.policy.model.gpt
        gpt.load_state_dict(dist_checkpointing.load(gpt.sharded_state_dict(), str(Path(path) / "model")))
        self.policy.load_state_dict(state)
        set_rng_state(state["rng"])
        mp_random.get_cuda_rng_tracker().set_states(state["rng_streams"])

    def pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        self.policy = None
        parallel.shutdown()
