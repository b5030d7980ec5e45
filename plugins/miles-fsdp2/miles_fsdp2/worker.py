"""One FSDP2 rank, run as a Ray actor: its shard of the policy (and reference model) and optimizer.

Every method that touches the model is a collective: the driver calls it on all ranks at once, each
with its own rows. The per-process training itself is :class:`miles.train.torch_backend.Policy`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard

from miles.train.api import (
    ConfigError,
    Policy,
    RendezvousHost,
    TrainBatch,
    TrainOptions,
    adapter_state,
    apply_lora,
    export_lora_weights,
    join_world,
    load_adapter_state,
    load_critic,
    load_model,
    merged_weights,
    quantized_training,
    resolve_device,
    rng_state,
    set_rng_state,
)

__all__ = ["FSDPWorker", "shard"]

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _placement(world_size: int):
    """Shard along the first dimension that splits evenly over the ranks (a value head's weight is
    ``[1, hidden]``: its first dimension cannot be split, its second can)."""
    def place(param: torch.nn.Parameter) -> Shard | None:
        for dim, size in enumerate(param.shape):
            if size % world_size == 0:
                return Shard(dim)
        return None  # FSDP's default: dimension 0, padded
    return place


def shard(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """``fully_shard`` each transformer block (the HF ``_no_split_modules`` classes), then the root."""
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    place = _placement(mesh.size())
    for module in model.modules():
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh, shard_placement_fn=place)
    fully_shard(model, mesh=mesh, shard_placement_fn=place)
    return model


class FSDPWorker:
    def __init__(self, rank: int, world_size: int, options: TrainOptions, threads: int) -> None:
        torch.set_num_threads(threads)
        self.rank, self.world_size, self.options = rank, world_size, options
        self.policy: Policy | None = None
        self.rendezvous: RendezvousHost | None = None

    def address(self, timeout_s: float) -> tuple[str, int]:
        """Rank 0 hosts the process group's rendezvous on this node, bound now; its address goes to every rank."""
        self.rendezvous = RendezvousHost.on_this_ray_node(self.world_size, timeout_s)
        return self.rendezvous.address

    def setup(self, master: tuple[str, int], model_path: str, seed: int, ref_model_path: str | None,
              total_steps: int | None, critic_model_path: str | None, timeout_s: float) -> None:
        device = resolve_device(self.options)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        join_world(self.rank, self.world_size, master, timeout_s, device, self.rendezvous)
        mesh = init_device_mesh(device.type, (self.world_size,))
        torch.manual_seed(seed)
        model = load_model(model_path)
        quantized_training(model, qat=self.options.qat, precision=self.options.precision)  # before sharding, as LoRA
        if self.options.lora is not None:  # adapters before sharding: FSDP2 shards frozen and trained parameters alike
            apply_lora(model, self.options.lora)
        model = shard(model.to(device), mesh).train()
        ref = None
        if ref_model_path is not None:
            ref = shard(load_model(ref_model_path).to(device).requires_grad_(False), mesh).eval()
        critic = None
        if critic_model_path is not None:
            critic = shard(load_critic(critic_model_path).to(device), mesh).train()
        self.policy = Policy(model, self.options, device, ref, total_steps, critic=critic)

    def train(self, batch: TrainBatch, plan: list[list[list[int]]], norms: list[tuple[float, float]], loss_fn: Any):
        # The gradient reduce-scatter averages over ranks; the loss is already divided by the global
        # token count, so scaling by the world size makes the result the single-process gradient.
        return self.policy.train(batch, plan, norms, loss_fn, loss_scale=float(self.world_size))

    def logprobs(self, batch: TrainBatch, micros: list[list[int]], reference: bool) -> list[torch.Tensor]:
        return self.policy.logprobs(batch, micros, reference=reference)

    def values(self, batch: TrainBatch, micros: list[list[int]]) -> list[torch.Tensor]:
        return self.policy.values(batch, micros)

    def full_weights(self, merged: bool = False) -> dict[str, torch.Tensor]:
        """All-gathers the full weights; only rank 0 returns them (others return an empty dict). With LoRA: what
        weight sync sends (``backend.lora.sync``), or with ``merged`` the merged weights (for save_pretrained)."""
        lora = self.options.lora
        if lora is not None and lora.sync == "adapters" and not merged:
            state = {name: (param.full_tensor() if hasattr(param, "full_tensor") else param).detach().cpu()
                     for name, param in self.policy.model.named_parameters() if param.requires_grad}
            return export_lora_weights(self.policy.model, lora, state) if self.rank == 0 else {}
        weights = get_model_state_dict(self.policy.model, options=_FULL)
        if self.rank != 0:
            return {}
        return weights if lora is None else merged_weights(self.policy.model, weights)

    def save_checkpoint(self, path: str) -> None:
        policy = self.policy
        model, optimizer = get_state_dict(policy.model, policy.optimizer, options=_FULL)
        if self.options.lora is not None:  # the adapters only: the base is the model the run set up from
            model = adapter_state(model)
        full = {"model": model, "optimizer": optimizer, "world_size": self.world_size}
        if policy.critic is not None:
            full["critic"], full["critic_optimizer"] = get_state_dict(policy.critic, policy.critic_optimizer,
                                                                      options=_FULL)
        if self.rank == 0:
            torch.save(full, Path(path) / "state.pt")
        torch.save({"scheduler": policy.scheduler.state_dict(), "steps_done": policy.steps_done, "rng": rng_state()},
                   Path(path) / f"rank{self.rank}.pt")

    def load_checkpoint(self, path: str) -> None:
        # Every rank reads the full state and keeps its shard (checkpoints live where all workers see them).
        full = torch.load(Path(path) / "state.pt", weights_only=False)
        if any(".lora_A." in name for name in full["model"]) != (self.options.lora is not None):
            saved = "with" if self.options.lora is None else "without"
            raise ConfigError(f"run.resume: checkpoint {path} was saved {saved} backend.lora and this run is not; "
                              f"resume with the backend it was saved with")
        options = StateDictOptions(full_state_dict=True)
        if self.options.lora is not None:
            def load(adapters: dict[str, torch.Tensor]) -> None:
                set_state_dict(self.policy.model, self.policy.optimizer, model_state_dict=dict(adapters),
                               optim_state_dict=full["optimizer"],
                               options=StateDictOptions(full_state_dict=True, strict=False))
            load_adapter_state(self.policy.model, full["model"], f"checkpoint {path}", load)
        else:
            set_state_dict(self.policy.model, self.policy.optimizer, model_state_dict=full["model"],
                           optim_state_dict=full["optimizer"], options=options)
        if self.policy.critic is not None:
            set_state_dict(self.policy.critic, self.policy.critic_optimizer, model_state_dict=full["critic"],
                           optim_state_dict=full["critic_optimizer"], options=options)
        own = Path(path) / f"rank{self.rank}.pt"
        if not own.is_file():
            raise FileNotFoundError(f"{own}: the checkpoint was written by fewer workers than this run's "
                                    f"world_size={self.world_size}")
        state = torch.load(own, weights_only=False)
        self.policy.scheduler.load_state_dict(state["scheduler"])
        self.policy.steps_done = state["steps_done"]
        set_rng_state(state["rng"])

    def pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        self.policy = None
        if dist.is_initialized():
            dist.destroy_process_group()
