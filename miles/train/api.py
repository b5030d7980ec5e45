"""What a training-backend plugin needs from Miles, in one place (``from miles.train import api``).

A backend plugin (``miles-fsdp2``, ``miles-megatron``, your own) imports only this module, ``miles``
and ``miles.testing``. It covers:

- the contract: :class:`TrainBackend`, :data:`LossFn`, :class:`TrainBatch`, :class:`LossInputs`;
- train options every backend takes: :class:`TrainOptions` (``@takes_train_options`` on the class
  merges its signature), :func:`resolve_device`, :func:`autocast_dtype`;
- the per-process training core: :class:`Policy` (model, AdamW, LR schedule, reference and value
  models; ``train`` runs one process's share of a step) and the RNG state to checkpoint
  (:func:`rng_state`, :func:`set_rng_state`);
- step plans: :func:`plan_batch` / :func:`plan_step` (mini-batches, token-balanced data-parallel
  shares, micro-batches; ``plan[mini][rank][micro] -> rows``), :func:`normalizers`,
  :func:`balanced_partition`, :func:`micro_batch_indices`;
- worker processes on Ray: :class:`RayWorkers` (placement with ``cluster.train_resources``, calls to all
  ranks, every worker stopped when one fails) and :class:`RayWorkersBackend`, the base of a backend built on
  one (``ray_cpus``, ``workers``, ``shutdown``); the process group joined without a port race: rank 0 makes a
  :class:`RendezvousHost` (bound when made) and every rank calls :func:`join_world` with its address;
- metric reduction across ranks: :func:`sum_over_ranks` then :func:`combine_metrics`, and
  :func:`assemble_rows` to put per-micro-batch rows back into ``[B, L-1]``;
- the losses' building blocks: :func:`token_logprobs` (whole, or memory-bounded with ``chunk_tokens``),
  :func:`value_loss`;
- log-prob kernels (``miles_register_logprob_kernels``): the :class:`LogprobKernel` contract, the reference
  :class:`TorchKernel`, :func:`select_kernel` (a name to the kernel for a device, in the calling process) and
  :func:`check_kernel_name` (a backend constructor refuses an unknown ``backend.logprob_kernel``);
- HF models: :func:`load_model`, :func:`load_critic`, :func:`save_pretrained`, :func:`save_state_dict`;
- LoRA (``backend.lora``, ``TrainOptions.lora`` is a :class:`LoraOptions`): :func:`apply_lora` (before sharding),
  :func:`check_lora_targets` (a config error before workers start), :func:`export_lora_weights` (what weight sync
  sends), :func:`merged_weights` (for ``save_pretrained``), :func:`adapter_state` / :func:`load_adapter_state`
  (checkpoints);
- low precision (``backend.qat``, ``backend.precision``): :func:`quantized_training` applies them to a model, before
  sharding (the layers keep their parameters: the state dict is unchanged);
- errors: :class:`ConfigError` (bad backend arguments, exit code 2), :class:`RunError`.

The conformance suite is ``miles.testing.BackendConformance``; docs/backends.md shows a backend
written against this module.
"""

from miles.train.losses import value_loss
from miles.errors import ConfigError, RunError
from miles.train.backend import LossFn, TrainBackend
from miles.train.batching import balanced_partition, micro_batch_indices, normalizers, plan_batch, plan_step
from miles.train.lora import LoraOptions, adapter_state, apply_lora, load_adapter_state, merged_weights
from miles.train.lora import check_targets as check_lora_targets
from miles.train.lora import export_weights as export_lora_weights
from miles.train.kernels import LogprobKernel, TorchKernel, check_kernel_name, select_kernel
from miles.train.options import TrainOptions, autocast_dtype, resolve_device, takes_train_options
from miles.train.process_group import RendezvousHost, join_world
from miles.train.ray_workers import RayWorkers, RayWorkersBackend
from miles.train.torch_backend import Policy, assemble_rows, combine_metrics, rng_state, set_rng_state, sum_over_ranks
from miles.types import LossInputs, TrainBatch
from miles.lazy import lazy_exports

# imported when first read (they import torch and transformers): a backend module that imports this one, read to
# check a config's arguments, stays light as long as it reads these inside its methods
_LAZY = {"load_model": "miles.models.hf", "load_critic": "miles.models.hf", "save_pretrained": "miles.models.hf",
         "save_state_dict": "miles.models.hf", "token_logprobs": "miles.train.logprobs",
         "quantized_training": "miles.precision.training"}
__getattr__ = lazy_exports(__name__, _LAZY)

__all__ = [
    "TrainBackend", "LossFn", "TrainBatch", "LossInputs",
    "TrainOptions", "takes_train_options", "resolve_device", "autocast_dtype",
    "Policy", "rng_state", "set_rng_state", "RayWorkers", "RayWorkersBackend", "RendezvousHost", "join_world",
    "plan_batch", "plan_step", "normalizers", "balanced_partition", "micro_batch_indices",
    "sum_over_ranks", "combine_metrics", "assemble_rows",
    "value_loss",
    "LogprobKernel", "TorchKernel", "select_kernel", "check_kernel_name",
    "LoraOptions", "apply_lora", "check_lora_targets", "export_lora_weights", "merged_weights", "adapter_state",
    "load_adapter_state",
    "ConfigError", "RunError",
    *_LAZY,
]
