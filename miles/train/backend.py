"""The contract between the loop and a training backend."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from miles.lazy import lazy_module
from miles.types import LossInputs, TrainBatch

torch = lazy_module("torch")

__all__ = ["TrainBackend", "LossFn", "BackendProxy"]

LossFn = Callable[[LossInputs], tuple["torch.Tensor", dict[str, float]]]


@runtime_checkable
class TrainBackend(Protocol):
    """A training backend owns the policy's trainable weights, its optimizer and LR schedule.

    The factory registered through ``miles_register_backends`` is called with the ``backend``
    config node's arguments (the shared :class:`miles.train.options.TrainOptions` plus its own);
    the loop then calls these methods. ``miles.testing.BackendConformance`` checks the contract.
    A backend whose workers are Ray actors sets the class attribute ``uses_ray = True``, and the
    runner starts (or joins) the configured Ray cluster before building it; its ``ray_cpus`` (the
    logical CPUs its workers reserve) is checked against ``cluster.num_cpus`` before the run starts; before
    ``setup`` the runner sets its ``ray_resources`` (``cluster.train_resources``: custom Ray resources each
    worker's bundle must also reserve, which place the workers on the nodes that offer them).
    The constructor only checks its arguments (``miles config`` builds it to run those checks, so it must not
    load anything: import torch lazily, ``miles.lazy.lazy_module``); work starts in ``setup``.
    """

    def setup(self, model_path: str, *, seed: int, ref_model_path: str | None = None,
              total_steps: int | None = None, critic_model_path: str | None = None) -> None:
        """Load the policy from an HF-format directory and build the optimizer and LR schedule
        (``total_steps`` training steps, for decaying schedules); with ``ref_model_path``, also a
        frozen reference model whose log-probs reach the loss as ``LossInputs.ref_logprobs``; with
        ``critic_model_path``, a value model (that checkpoint with a scalar head) trained on
        ``batch.returns`` whenever a batch carries them (PPO)."""

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """``[B, L-1]`` log-probs of the batch's tokens under the current policy (no gradient);
        padded and prompt columns hold arbitrary values (the loss mask removes them)."""

    def ref_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """``[B, L-1]`` log-probs under the reference model (only when one was set up)."""

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        """``[B, L-1]`` value estimates (column ``t``: the state that predicts token ``t + 1``; only
        when a value model was set up)."""

    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        """Optimizer step(s) on ``batch``, split into micro-batches as configured; the loss is
        normalised by the batch's loss-mask tokens, so the split does not change the result.

        Returns metrics including ``train/loss``, ``train/grad_norm``, ``train/kl``,
        ``train/entropy``, ``train/clip_frac``, ``train/rollout_logprob_abs_diff`` and ``train/lr``.
        """

    def export_weights(self) -> dict[str, torch.Tensor]:
        """The full current weights by HF parameter name, on CPU, for weight sync (not to be modified)."""

    def save_pretrained(self, path: str, tokenizer: Any = None, metadata: dict | None = None) -> None:
        """Write the policy in HF format (safetensors), atomically, with ``metadata`` as ``miles.json``."""

    def save_checkpoint(self, path: str) -> None:
        """Write everything needed to continue training (weights, optimizer, schedule, RNG states)
        into the existing empty directory ``path``; the runner makes the whole checkpoint atomic."""

    def load_checkpoint(self, path: str) -> None:
        """Restore what ``save_checkpoint`` wrote, after ``setup`` with the same model."""

    def shutdown(self) -> None:
        """Release workers and memory."""


class BackendProxy:
    """A backend that runs elsewhere (a Ray actor, a child process), seen through its contract: each method sends
    its call through :meth:`_call`, a batch first through :meth:`_batch` (what of it crosses)."""

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def _batch(self, batch: TrainBatch) -> TrainBatch:
        return batch

    def setup(self, model_path: str, *, seed: int, **options: Any) -> None:
        self._call("setup", model_path, seed=seed, **options)

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self._call("compute_logprobs", self._batch(batch))

    def ref_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self._call("ref_logprobs", self._batch(batch))

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        return self._call("compute_values", self._batch(batch))

    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        return self._call("train_step", self._batch(batch), loss_fn)

    def export_weights(self) -> dict[str, torch.Tensor]:
        return self._call("export_weights")

    def save_pretrained(self, path: str, tokenizer: Any = None, metadata: dict | None = None) -> None:
        self._call("save_pretrained", path, tokenizer, metadata)

    def save_checkpoint(self, path: str) -> None:
        self._call("save_checkpoint", path)

    def load_checkpoint(self, path: str) -> None:
        self._call("load_checkpoint", path)
