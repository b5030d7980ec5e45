"""The driver side of the FSDP2 backend: places ``world_size`` worker actors, splits each batch
among them (balanced by tokens) and combines what they return."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.train.api import (
    ConfigError,
    LossFn,
    RayWorkers,
    RayWorkersBackend,
    TrainBatch,
    TrainOptions,
    assemble_rows,
    check_kernel_name,
    check_lora_targets,
    combine_metrics,
    normalizers,
    plan_batch,
    sum_over_ranks,
    takes_train_options,
)

if TYPE_CHECKING:
    import torch

__all__ = ["FSDP2Backend"]


def _remap(micros: list[list[int]], index: dict[int, int]) -> list[list[int]]:
    return [[index[r] for r in rows] for rows in micros]


@takes_train_options
class FSDP2Backend(RayWorkersBackend):
    """Registered as backend ``fsdp2``: FSDP2 over ``world_size`` Ray worker processes.

    Workers reserve ``cpus_per_worker`` CPUs each, and one GPU each when training on a GPU
    (``device`` cuda, or auto on a cluster with GPUs): gloo on CPU, NCCL on GPU. Other arguments:
    :class:`miles.train.options.TrainOptions`.
    """

    name = "fsdp2"

    def __init__(self, world_size: int = 2, cpus_per_worker: float = 1.0, startup_timeout_s: float = 600.0,
                 collective_timeout_s: float = 600.0, **options: Any) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if cpus_per_worker <= 0:
            raise ValueError(f"cpus_per_worker must be positive, got {cpus_per_worker}")
        self.options = TrainOptions(**options)
        check_kernel_name(self.options.logprob_kernel)  # each worker then picks the kernel for its device
        self.world_size, self.cpus_per_worker = world_size, cpus_per_worker
        self.startup_timeout_s, self.collective_timeout_s = startup_timeout_s, collective_timeout_s
        self.group = RayWorkers("fsdp2", world_size, cpus_per_worker, startup_timeout_s)
        self._model_path: str | None = None

    def setup(self, model_path: str, *, seed: int, ref_model_path: str | None = None,
              total_steps: int | None = None, critic_model_path: str | None = None) -> None:
        from miles_fsdp2.worker import FSDPWorker

        if self.options.lora is not None:  # target_modules that fit no layer: a config error before workers start
            check_lora_targets(model_path, self.options.lora)
        threads = max(1, int(self.cpus_per_worker))
        self.group.start(FSDPWorker, self.options.device, self.ray_resources,
                         lambda rank: (rank, self.world_size, self.options, threads))
        master = self.group.gather([self.workers[0].address.remote(self.collective_timeout_s)], "setup")[0]
        self._all("setup", master, model_path, seed, ref_model_path, total_steps, critic_model_path,
                  self.collective_timeout_s)
        self._model_path = model_path

    def _shares(self, batch: TrainBatch, plan: list[list[list[int]]]) -> list[tuple[TrainBatch, list[list[list[int]]]]]:
        """Each rank's rows as a batch of its own, with the plan in that batch's row numbers."""
        shares = []
        for rank in range(self.world_size):
            rows = sorted({r for mini in plan for micro in mini[rank] for r in micro}) or [0]
            index = {row: i for i, row in enumerate(rows)}
            shares.append((batch.select(rows), [_remap(mini[rank], index) for mini in plan]))
        return shares

    # -- the backend contract ------------------------------------------------------------------------

    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        plan = plan_batch(batch, self.options, world_size=self.world_size, mini_batches=self.options.mini_batches,
                          epochs=self.options.epochs)
        results = self._all("train", normalizers(batch.loss_mask, plan), loss_fn, per_rank=self._shares(batch, plan))
        sums = sum_over_ranks([rank_sums for rank_sums, _, _ in results])
        return combine_metrics(sums, results[0][1], results[0][2])  # norms and lr are global

    def _per_row(self, method: str, batch: TrainBatch, *args: Any) -> torch.Tensor:
        """``[B, L-1]`` from a per-micro-batch worker method, each rank on its share of the rows."""
        plan = plan_batch(batch, self.options, world_size=self.world_size)
        shares = self._shares(batch, plan)
        results = self._all(method, *args, per_rank=[(share, local[0]) for share, local in shares])
        micros = [micro for rank in range(self.world_size) for micro in plan[0][rank]]
        return assemble_rows(batch, micros, [values for rank_values in results for values in rank_values])

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self._per_row("logprobs", batch, False)

    def ref_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self._per_row("logprobs", batch, True)

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        return self._per_row("values", batch)

    def export_weights(self) -> dict[str, torch.Tensor]:
        return self._all("full_weights")[0]  # with LoRA: merged, or the adapters only (backend.lora.sync)

    def save_pretrained(self, path: str, tokenizer: Any = None, metadata: dict | None = None) -> None:
        from miles.train.api import save_state_dict  # torch, transformers: when a run saves, not when it starts

        save_state_dict(self._all("full_weights", True)[0], self._model_path, path, tokenizer, metadata)

    def save_checkpoint(self, path: str) -> None:
        self._all("save_checkpoint", path)

    def load_checkpoint(self, path: str) -> None:
        if not (Path(path) / "state.pt").is_file():
            raise ConfigError(f"run.resume: {path} holds no fsdp2 checkpoint (no state.pt)")
        self._all("load_checkpoint", path)
