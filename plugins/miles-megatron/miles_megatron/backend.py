"""The driver side of the Megatron backend: checks the parallel layout, places ``world_size`` worker
actors, gives each data-parallel rank its rows (balanced by tokens) and turns the ranks' Megatron
shards back into HF weights."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.train.api import (
    ConfigError,
    LossFn,
    RayWorkers,
    RayWorkersBackend,
    RunError,
    TrainBatch,
    TrainOptions,
    assemble_rows,
    combine_metrics,
    normalizers,
    plan_batch,
    sum_over_ranks,
    takes_train_options,
)
from miles_megatron.arch import Parallel

if TYPE_CHECKING:
    import torch

__all__ = ["MegatronBackend"]

# What megatron-core needs that this backend does not provide on CPU, for the error messages.
_NOT_RUNNABLE = {
    "pipeline_parallel": "the step runs each rank's whole model; megatron's pipeline schedules are not wired in yet",
    "context_parallel": "context parallelism needs Transformer Engine's attention (not part of the local layer spec)",
}


def _remap(micros: list[list[int]], index: dict[int, int]) -> list[list[int]]:
    return [[index[r] for r in rows] for rows in micros]


@takes_train_options
class MegatronBackend(RayWorkersBackend):
    """Registered as backend ``megatron``: a megatron-core GPTModel over ``world_size`` Ray workers.

    ``tensor_parallel``, ``pipeline_parallel``, ``context_parallel`` and ``expert_parallel`` go to
    megatron's ``parallel_state``; data parallelism is the rest of ``world_size``.
    ``sequence_packing`` runs each micro-batch's rows as one packed sequence (no compute on padding).
    ``distributed_optimizer`` asks for megatron's sharded optimizer (not available yet: refused).
    Other arguments: :class:`miles.train.options.TrainOptions`.
    """

    name = "megatron"

    def __init__(self, world_size: int = 1, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                 context_parallel: int = 1, expert_parallel: int = 1, sequence_packing: bool = False,
                 distributed_optimizer: bool = False, cpus_per_worker: float = 1.0, startup_timeout_s: float = 600.0,
                 collective_timeout_s: float = 600.0, **options: Any) -> None:
        sizes = {"world_size": world_size, "tensor_parallel": tensor_parallel, "pipeline_parallel": pipeline_parallel,
                 "context_parallel": context_parallel, "expert_parallel": expert_parallel}
        for key, value in sizes.items():
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"backend.{key} must be an integer >= 1, got {value!r}")
        model_parallel = tensor_parallel * pipeline_parallel * context_parallel
        if world_size % model_parallel:
            raise ConfigError(f"backend.world_size={world_size} must be divisible by tensor_parallel x "
                              f"pipeline_parallel x context_parallel = {model_parallel}")
        if world_size % (expert_parallel * pipeline_parallel):
            raise ConfigError(f"backend.expert_parallel={expert_parallel}: world_size={world_size} must be divisible "
                              f"by expert_parallel x pipeline_parallel = {expert_parallel * pipeline_parallel}")
        if cpus_per_worker <= 0:
            raise ConfigError(f"backend.cpus_per_worker must be positive, got {cpus_per_worker}")
        if distributed_optimizer:
            raise ConfigError("backend.distributed_optimizer: megatron-core's DistributedOptimizer is not wired in "
                              "yet (on CPU it cannot run: megatron/core/optimizer/optimizer.py and clip_grads.py "
                              "allocate on 'cuda'); set it to false")
        self.options = TrainOptions(**options)
        if self.options.qat is not None or self.options.precision is not None:
            raise ConfigError("backend.qat, backend.precision: the megatron backend does not quantize its layers yet; "
                              "QAT and low-precision training run with the torch backend (docs/precision.md)")
        if self.options.logprob_chunk_tokens != 0 or self.options.logprob_kernel != "torch":
            key = "logprob_chunk_tokens" if self.options.logprob_chunk_tokens != 0 else "logprob_kernel"
            raise ConfigError(f"backend.{key}={getattr(self.options, key)!r}: the megatron backend computes log-probs "
                              f"its own way (from its tensor-parallel output layer); the chunked path and its kernels "
                              f"are for torch and fsdp2: leave logprob_chunk_tokens at 0 and logprob_kernel at torch")
        if self.options.routing_replay or self.options.router_aux_loss_coef:
            key = "routing_replay" if self.options.routing_replay else "router_aux_loss_coef"
            raise ConfigError(f"backend.{key}={getattr(self.options, key)!r}: routing replay and the router's aux loss "
                              f"are not wired into the megatron backend yet (megatron-core routes inside its own MoE "
                              f"layer); use backend torch or fsdp2 for them (docs/moe.md)")
        if self.options.share_prefixes == "true":
            raise ConfigError("backend.share_prefixes=true: prefix-shared training packs HF models' rows into a tree "
                              "mask, which the megatron backend does not; use backend torch or fsdp2 for it, or "
                              "share_prefixes auto or false (docs/backends.md)")
        if self.options.lora is not None:
            raise ConfigError("backend.lora: LoRA (through peft, on HF modules) is not wired into the megatron backend "
                              "(megatron-core's own layers); use backend torch or fsdp2 for it (docs/lora.md)")
        self.world_size, self.cpus_per_worker = world_size, cpus_per_worker
        self.sizes = Parallel(tp=tensor_parallel, pp=pipeline_parallel, cp=context_parallel, ep=expert_parallel)
        self.sequence_packing = sequence_packing
        self.startup_timeout_s, self.collective_timeout_s = startup_timeout_s, collective_timeout_s
        self.data_parallel = world_size // model_parallel
        self.group = RayWorkers("megatron", world_size, cpus_per_worker, startup_timeout_s)
        self.coords: list[dict[str, int]] = []
        self._model_path: str | None = None
        self._spec: Any = None

    # -- placement -----------------------------------------------------------------------------------

    def _check_model(self, model_path: str) -> Any:
        """The model's spec, after checking that the parallel layout fits it."""
        from transformers import AutoConfig

        from miles_megatron.arch import model_spec

        spec = model_spec(AutoConfig.from_pretrained(model_path))
        tp, ep = self.sizes.tp, self.sizes.ep
        for what, count in (("num_attention_heads", spec.num_heads), ("num_key_value_heads", spec.num_query_groups)):
            if count % tp:
                raise ConfigError(f"backend.tensor_parallel={tp} must divide the model's {what} ({count})")
        if ep > 1 and not spec.num_experts:
            raise ConfigError(f"backend.expert_parallel={ep} needs a mixture-of-experts model; "
                              f"{model_path} has no experts")
        if spec.num_experts and spec.num_experts % ep:
            raise ConfigError(f"backend.expert_parallel={ep} must divide the model's num_experts ({spec.num_experts})")
        if spec.num_experts and tp > 1:
            raise ConfigError(f"backend.tensor_parallel={tp} with a mixture-of-experts model is not supported yet "
                              f"(use expert_parallel for the experts and tensor_parallel 1)")
        if spec.num_layers % self.sizes.pp:
            raise ConfigError(f"backend.pipeline_parallel={self.sizes.pp} must divide the model's "
                              f"num_hidden_layers ({spec.num_layers})")
        return spec

    def setup(self, model_path: str, *, seed: int, ref_model_path: str | None = None,
              total_steps: int | None = None, critic_model_path: str | None = None) -> None:
        from miles_megatron.worker import MegatronWorker

        if critic_model_path is not None:
            raise ConfigError("backend megatron has no value model yet (PPO's critic): use backend torch or fsdp2")
        self.shutdown()
        self._spec = self._check_model(model_path)
        threads = max(1, int(self.cpus_per_worker))
        self.group.start(MegatronWorker, self.options.device, self.ray_resources,
                         lambda rank: (rank, self.world_size, self.sizes, self.options, self.sequence_packing, threads))
        master = self.group.gather([self.workers[0].address.remote(self.collective_timeout_s)], "setup")[0]
        self.coords = self._all("init_groups", master, seed, self.collective_timeout_s)
        for key in ("pipeline_parallel", "context_parallel"):
            size = {"pipeline_parallel": self.sizes.pp, "context_parallel": self.sizes.cp}[key]
            if size > 1:
                self.shutdown()
                raise ConfigError(f"backend.{key}={size}: megatron's parallel groups were built, "
                                  f"but {_NOT_RUNNABLE[key]}; set it to 1")
        self._all("setup", model_path, seed, ref_model_path, total_steps)
        self._model_path = model_path

    # -- calling the workers -------------------------------------------------------------------------

    def _shares(self, batch: TrainBatch, plan: list[list[list[list[int]]]]) -> list[tuple[TrainBatch, list]]:
        """Each worker's rows (those of its data-parallel rank) as a batch, with the plan in its row numbers."""
        by_dp = []
        for dp in range(self.data_parallel):
            rows = sorted({r for mini in plan for micro in mini[dp] for r in micro}) or [0]
            index = {row: i for i, row in enumerate(rows)}
            by_dp.append((batch.select(rows), [_remap(mini[dp], index) for mini in plan]))
        return [by_dp[c["dp"]] for c in self.coords]

    def _leads(self) -> list[int]:
        """One worker per data-parallel rank (the others of its model-parallel group repeat its results)."""
        return [k for k, c in enumerate(self.coords) if c["tp"] == 0 and c["cp"] == 0 and c["pp"] == 0]

    # -- the backend contract ------------------------------------------------------------------------

    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        plan = plan_batch(batch, self.options, world_size=self.data_parallel, mini_batches=self.options.mini_batches,
                          epochs=self.options.epochs)
        results = self._all("train", normalizers(batch.loss_mask, plan), loss_fn, per_rank=self._shares(batch, plan))
        sums = sum_over_ranks([results[k][0] for k in self._leads()])
        return combine_metrics(sums, results[0][1], results[0][2])  # norms and lr are global

    def _per_row(self, batch: TrainBatch, reference: bool) -> torch.Tensor:
        plan = plan_batch(batch, self.options, world_size=self.data_parallel)
        shares = self._shares(batch, plan)
        results = self._all("logprobs", reference, per_rank=[(share, local[0]) for share, local in shares])
        micros, values = [], []
        for k in self._leads():
            micros += plan[0][self.coords[k]["dp"]]
            values += results[k]
        return assemble_rows(batch, micros, values)

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self._per_row(batch, False)

    def ref_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self._per_row(batch, True)

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        raise RunError("backend megatron has no value model")

    def export_weights(self) -> dict[str, torch.Tensor]:
        """HF weights: every rank's Megatron shard, joined (tensor- and expert-parallel) and converted."""
        from miles_megatron.convert import megatron_to_hf, unshard

        local = self._all("local_weights")
        shards: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        for k, coords in enumerate(self.coords):
            if coords["pp"] == 0 and coords["cp"] == 0:
                shards.setdefault((coords["tp"], coords["ep"]), local[k])
        full = unshard(shards, self._spec, tp_size=self.sizes.tp, ep_size=self.sizes.ep)
        return megatron_to_hf(full, self._spec)

    def save_pretrained(self, path: str, tokenizer: Any = None, metadata: dict | None = None) -> None:
        from miles.train.api import save_state_dict  # torch, transformers: when a run saves, not when it starts

        save_state_dict(self.export_weights(), self._model_path, path, tokenizer, metadata)

    def save_checkpoint(self, path: str) -> None:
        self._all("save_checkpoint", path)

    def load_checkpoint(self, path: str) -> None:
        if not (Path(path) / "model").is_dir() or not (Path(path) / "rank0.pt").is_file():
            raise ConfigError(f"run.resume: {path} holds no megatron checkpoint (no model/ and rank0.pt)")
        self._all("load_checkpoint", path)
