"""The builtin single-process torch backend, and the per-process training core that sharded backends
(the ``miles-fsdp2`` plugin) reuse: :class:`Policy` runs one planned step on one process's share."""

from __future__ import annotations

import contextlib
import math
import random
from collections import defaultdict
from pathlib import Path
from typing import Any

from miles.lazy import lazy_module
from miles.train.losses import NonFiniteLoss, non_finite_inputs, value_loss
from miles.errors import ConfigError
from miles.train.backend import LossFn
from miles.train.batching import normalizers, plan_batch
from miles.train import lora
from miles.train.kernels import check_kernel_name, select_kernel
from miles.models.vision import row_inputs, vision_spec, vision_tower
from miles.train.options import TrainOptions, autocast_dtype, resolve_device, takes_train_options
from miles.models.moe import moe_layout, routing
from miles.train.regularizers import kl_estimate
from miles.types import LossInputs, TrainBatch

torch = lazy_module("torch")
low_precision = lazy_module("miles.precision.training")  # QAT, training in low precision: docs/precision.md
# imported when first used: `miles config` reads TorchBackend's arguments without torch or transformers
hf = lazy_module("miles.models.hf")
prefix_tree = lazy_module("miles.train.prefix_tree")
logprob_paths = lazy_module("miles.train.logprobs")

__all__ = ["TorchBackend", "Policy", "rng_state", "set_rng_state"]

# Metrics that are counts, summed over mini-batches rather than averaged.
_COUNTS = ("train/micro_batches",)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Policy:
    """One process's policy: model, AdamW, LR schedule, optional frozen reference model.

    ``train`` runs this process's share of a plan (:mod:`miles.train.batching`); a sharded backend
    passes ``loss_scale=world_size`` because its gradient reduction averages over ranks while the
    loss is already normalised by the global token count, and sums the returned metrics over ranks.
    """

    def __init__(self, model: torch.nn.Module, options: TrainOptions, device: torch.device,
                 ref_model: torch.nn.Module | None = None, total_steps: int | None = None,
                 optimizer: torch.optim.Optimizer | None = None, critic: torch.nn.Module | None = None) -> None:
        self.model, self.ref_model, self.options, self.device = model, ref_model, options, device
        self.moe = moe_layout(model)  # None for a dense model
        self.vision = vision_spec(getattr(model, "config", None))  # None for a text-only model
        if self.vision is not None and options.freeze_vision:
            vision_tower(model).requires_grad_(False)  # before the optimizer takes the parameters
        self._ref_moe = None
        if self.moe is None and (options.routing_replay or options.router_aux_loss_coef):
            raise ValueError("routing_replay and router_aux_loss_coef need a mixture-of-experts model; this model "
                             "has no expert router")
        self.critic = critic
        self.critic_optimizer = None if critic is None else torch.optim.AdamW(
            critic.parameters(), lr=options.critic_lr or options.lr, betas=(options.beta1, options.beta2),
            weight_decay=options.weight_decay)
        self.steps_done = 0
        self.autocast = autocast_dtype(options, device)
        # The chunked log-prob path's kernel, chosen in this process (a worker's plugins, its device).
        self.logprob_kernel = select_kernel(options.logprob_kernel, device) if options.logprob_chunk_tokens else None
        # backend.share_prefixes: a model that cannot take a tree mask is refused here under `true`
        models = [m for m in (model, ref_model, critic) if m is not None]
        pad_token_id = getattr(getattr(model, "config", None), "pad_token_id", None) or 0
        self.sharing = prefix_tree.PrefixSharing(options.share_prefixes, models,
                                                 exact_logprobs=options.exact_logprobs,
                                                 routing_replay=options.routing_replay,
                                                 pad_token_id=pad_token_id)
        # only what trains (with LoRA: the adapters) has optimizer state
        self.optimizer = optimizer or torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=options.lr, betas=(options.beta1, options.beta2),
            weight_decay=options.weight_decay)
        total = None if total_steps is None else total_steps * options.mini_batches * options.epochs
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda k: options.lr_factor(k, total))

    def _autocast(self) -> Any:
        return torch.autocast(self.device.type, dtype=self.autocast) if self.autocast else contextlib.nullcontext()

    def _forward(self, model: torch.nn.Module, micro: TrainBatch, **kwargs: Any):
        if self.options.exact_logprobs:
            if micro.images is not None:
                raise ValueError("exact_logprobs (rollout.true_on_policy) covers text-only samples; these hold images")
            return self._exact_forward(model, micro, kwargs.get("with_entropy", False))
        tree = self.sharing.pack(micro)
        input_ids = micro.input_ids.to(self.device)
        if self.vision is not None:  # multimodal positions, and the pixels of the rows' images
            kwargs["inputs"] = row_inputs(self.vision, input_ids, micro.attention_mask.sum(dim=1).tolist(),
                                          micro.images or [[] for _ in range(len(micro))])
            kwargs["never_generated"] = self.vision.never_generated
        elif micro.images is not None:
            raise ValueError("the samples hold images, but the model is text-only (its config has no vision tower)")
        with self._autocast():
            logprobs = logprob_paths.token_logprobs if tree is None else tree.logprobs
            return logprobs(model, input_ids, chunk_tokens=self.options.logprob_chunk_tokens,
                            kernel=self.logprob_kernel, sampling=micro.sampling, **kwargs)

    def _exact_forward(self, model: torch.nn.Module, micro: TrainBatch, with_entropy: bool):
        """``[B, L-1]`` log-probs (and entropy), each row by :func:`miles.models.hf.exact_logprobs` (bit-identical to an
        engine with ``exact_logprobs``, whatever the batch)."""
        length = int(model.config.max_position_embeddings)
        pad = int(getattr(model.config, "pad_token_id", None) or 0)
        width = micro.input_ids.shape[1] - 1
        rows = []
        for row, (ids, n) in enumerate(zip(micro.input_ids, micro.attention_mask.sum(dim=1).tolist())):
            sampling = {} if micro.sampling is None else micro.sampling.row(row, n - 1, self.device)
            out = hf.exact_logprobs(model, ids[:n], length=length, pad_token_id=pad, with_entropy=with_entropy,
                                    **sampling)
            parts = out if with_entropy else (out,)
            rows.append([torch.nn.functional.pad(t, (0, width - t.shape[0])) for t in parts])
        if not rows:
            empty = torch.zeros((0, width), device=self.device)
            return (empty, empty) if with_entropy else empty
        stacked = [torch.stack(column) for column in zip(*rows)]
        return tuple(stacked) if with_entropy else stacked[0]

    def _routing(self, model: torch.nn.Module, micro: TrainBatch, record: bool = False) -> Any:
        """The routing of one forward of ``model`` (the policy or the reference model, the same architecture) over
        ``micro``: with ``routing_replay``, the engine's experts where the samples have them; ``record`` keeps the
        policy's choices and router logits (the load-balancing loss and the routing metrics)."""
        if self.moe is None:
            return contextlib.nullcontext()
        if model is not self.model and self._ref_moe is None:
            self._ref_moe = moe_layout(model)
        block = routing(model, replay=self._replay(micro), record=record, keep_logits=record,
                        layout=self.moe if model is self.model else self._ref_moe)
        tree = self.sharing.pack(micro)  # a tree's record is turned back into rows when the block ends
        return block if tree is None else tree.rows_of(block)

    def _replay(self, micro: TrainBatch) -> torch.Tensor | None:
        if not self.options.routing_replay:
            return None
        if micro.routed_experts is None:
            raise ValueError("routing_replay: the samples hold no routed_experts; set rollout.return_routed_experts: "
                             "true (and use a rollout function that records them, as single_turn and multi_turn do)")
        tree = self.sharing.pack(micro)
        return (micro.routed_experts if tree is None else tree.routed_experts).to(self.device)

    def _routed_forward(self, model: torch.nn.Module, micro: TrainBatch, **kwargs: Any):
        """``_forward`` within ``_routing`` (no record): log-probs of the policy or the reference model."""
        with self._routing(model, micro):
            return self._forward(model, micro, **kwargs)

    def _moe_metrics(self, record: Any, micro: TrainBatch, weight: float) -> tuple[torch.Tensor, dict[str, float]]:
        """The load-balancing loss (weighted by the micro-batch's share of the loss tokens) and the routing
        figures of one micro-batch: ``moe/aux_loss``, ``moe/expert_load_max_frac`` and, when the samples carry the
        engine's expert ids, ``train/routing_mismatch_frac`` (the share of (token, MoE layer) pairs whose experts
        differ from the engine's; 0 with routing replay)."""
        tokens = micro.attention_mask.to(self.device).bool()
        aux, top = record.load_stats(tokens)
        metrics = {"moe/aux_loss": float(aux.detach()) * weight, "moe/expert_load_max_frac": float(top) * weight}
        if micro.routed_experts is not None:
            layout = record.layout
            mine = record.routed(len(micro)).reshape(*tokens.shape, layout.num_layers, layout.top_k)
            engine = micro.routed_experts.to(self.device).long().reshape(mine.shape)
            layers = torch.tensor(sorted(record.ids), device=self.device)
            mine, engine = mine[:, :, layers].sort(dim=-1).values, engine[:, :, layers].sort(dim=-1).values
            known = tokens.unsqueeze(-1) & (engine >= 0).all(dim=-1)  # [b, L, moe layers]
            differ = (mine != engine).any(dim=-1) & known
            if bool(known.any()):
                metrics["train/routing_mismatch_frac"] = float(differ.sum()) / float(known.sum()) * weight
        return aux * weight, metrics

    def _micro(self, batch: TrainBatch, rows: list[int]) -> TrainBatch:
        if rows:
            return batch.select(rows)
        placeholder = batch.select([0])  # keeps collectives in step on a rank with nothing to do
        placeholder.loss_mask = torch.zeros_like(placeholder.loss_mask)
        return placeholder

    def _values(self, micro: TrainBatch) -> torch.Tensor:
        """``[b, L-1]``: column ``t`` is the value of the state that predicts token ``t + 1``."""
        tree = self.sharing.pack(micro)
        with self._autocast():
            if tree is not None:
                return tree.values(self.critic, self.device)
            return self.critic(input_ids=micro.input_ids.to(self.device)).logits[:, :-1, 0].float()

    def _per_micro(self, batch: TrainBatch, micros: list[list[int]], fn: Any) -> list[torch.Tensor]:
        """``fn(micro)`` of each micro-batch on CPU, without gradient (placeholders give empty tensors)."""
        out = []
        with torch.no_grad():
            for rows in micros:
                values = fn(self._micro(batch, rows)).float().cpu()
                out.append(values if rows else values[:0])
        return out

    def values(self, batch: TrainBatch, micros: list[list[int]]) -> list[torch.Tensor]:
        if self.critic is None:
            raise ValueError("no value model: set up the backend with critic_model_path")
        return self._per_micro(batch, micros, self._values)

    def _train_critic(self, batch: TrainBatch, micros: list[list[int]], normalizer: float,
                      loss_scale: float) -> dict[str, float]:
        """One value-model step on :func:`miles.train.losses.value_loss`."""
        self.critic_optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = defaultdict(float)
        for rows in micros:
            micro = self._micro(batch, rows)
            values = self._values(micro)
            if not rows:
                (values.sum() * 0.0).backward()
                continue
            loss, metrics = value_loss(values, micro.values.to(self.device), micro.returns.to(self.device),
                                       micro.loss_mask.to(self.device), normalizer, self.options.value_clip)
            (loss * loss_scale).backward()
            totals["critic/loss"] += float(loss.detach())
            for key, value in metrics.items():
                totals[key] += value
        norm = torch.nn.utils.clip_grad_norm_(self.critic.parameters(), self.options.max_grad_norm or float("inf"))
        totals["critic/grad_norm"] = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        self.critic_optimizer.step()
        return totals

    def logprobs(self, batch: TrainBatch, micros: list[list[int]], reference: bool = False) -> list[torch.Tensor]:
        """Log-probs of each micro-batch's rows (``[b, width]``; placeholders give empty tensors)."""
        model = self.ref_model if reference else self.model
        if model is None:
            raise ValueError("no reference model: set up the backend with ref_model_path")
        return self._per_micro(batch, micros, lambda micro: self._routed_forward(model, micro))

    def train(self, batch: TrainBatch, plan: list[list[list[int]]], norms: list[tuple[float, float]], loss_fn: LossFn,
              loss_scale: float = 1.0) -> tuple[list[dict[str, float]], list[float], float]:
        sums, grad_norms, lr = self._train(batch, plan, norms, loss_fn, loss_scale)
        self.steps_done += 1
        return sums, grad_norms, lr

    def _train(self, batch: TrainBatch, plan: list[list[list[int]]], norms: list[tuple[float, float]], loss_fn: LossFn,
               loss_scale: float) -> tuple[list[dict[str, float]], list[float], float]:
        """Run ``plan[mini_batch][micro_batch] -> rows`` with ``norms[mini_batch] = (tokens, sequences)``
        over all ranks; returns per-mini-batch metric sums, gradient norms, and the learning rate of
        the first optimizer step."""
        lr = self.scheduler.get_last_lr()[0]
        if self.options.old_logprobs == "recompute":  # all before the first optimizer step
            passes = self.options.epochs if len(plan) % self.options.epochs == 0 else 1
            olds = [self.logprobs(batch, micros) for micros in plan[: len(plan) // passes]] * passes
        sums, grad_norms = [], []
        needs_entropy_grad = getattr(loss_fn, "needs_entropy_grad", False)
        train_critic = self.critic is not None and batch.returns is not None
        warming_up = train_critic and self.steps_done < self.options.critic_warmup_steps
        for k, micros in enumerate(plan):
            normalizer, sequences = max(norms[k][0], 1.0), max(norms[k][1], 1.0)
            critic_totals = self._train_critic(batch, micros, normalizer, loss_scale) if train_critic else {}
            if warming_up:  # only the value model learns during its warm-up
                sums.append({**critic_totals, "train/critic_warmup": 1.0})
                grad_norms.append(0.0)
                continue
            self.optimizer.zero_grad(set_to_none=True)
            totals: dict[str, float] = defaultdict(float, critic_totals)
            non_finite = None  # what made this rank's loss NaN or inf
            for m, rows in enumerate(micros):
                micro = self._micro(batch, rows)
                with self._routing(self.model, micro, record=True) as record:
                    logprobs, entropy = self._forward(self.model, micro, with_entropy=True,
                                                      entropy_grad=needs_entropy_grad)
                if not rows:
                    (logprobs.sum() * 0.0).backward()
                    continue
                logprobs, entropy = logprobs.float(), entropy.float()
                old = (olds[k][m].to(self.device) if self.options.old_logprobs == "recompute"
                       else micro.rollout_logprobs.to(self.device))
                ref = (self._routed_forward(self.ref_model, micro).float().detach() if self.ref_model is not None
                       else None)
                mask = micro.loss_mask.to(self.device)
                advantages = None if micro.advantages is None else micro.advantages.to(self.device)
                inputs = LossInputs(logprobs, old, advantages, mask, normalizer, micro, ref, entropy, sequences)
                loss, metrics = loss_fn(inputs)
                if record is not None:  # an MoE model: its routing figures, and the router's aux loss if asked for
                    aux, moe_metrics = self._moe_metrics(record, micro, float(mask.sum()) / normalizer)
                    metrics = {**metrics, **moe_metrics}
                    if self.options.router_aux_loss_coef:
                        loss = loss + self.options.router_aux_loss_coef * aux
                (loss * loss_scale).backward()
                with torch.no_grad():
                    if not math.isfinite(value := float(loss.detach())) and non_finite is None:
                        non_finite = (f"the loss of micro-batch {m + 1} of optimizer step {k + 1} is {value}: "
                                      f"{non_finite_inputs(inputs)}")
                    totals["train/loss"] += value
                    for key, value in metrics.items():
                        totals[key] += float(value)
                    totals["train/entropy"] += float((entropy * mask).sum()) / normalizer
                    # KL to the reference model; with none configured, to the policy that sampled the batch.
                    totals["train/kl"] += float(
                        (kl_estimate(logprobs, old if ref is None else ref, "k3") * mask).sum()) / normalizer
                    # How far the trainer's log-probs are from the engine's for the same tokens (0 when they agree).
                    rollout = micro.rollout_logprobs.to(self.device)
                    gap = (logprobs - rollout).abs()
                    totals["train/rollout_logprob_abs_diff"] += float((gap * mask).sum()) / normalizer
                    # KL(engine || trainer) over the sampled tokens (k3: r - 1 - log r, r = p_trainer / p_engine)
                    mismatch_kl = kl_estimate(rollout, logprobs, "k3")
                    totals["train/rollout_kl"] += float((mismatch_kl * mask).sum()) / normalizer
                    if k == 0 and mask.any():  # before the first optimizer step: numerics alone (0.0 when exact)
                        totals["train/logprob_abs_diff_max"] = max(totals.get("train/logprob_abs_diff_max", 0.0),
                                                                   float(gap[mask > 0].max()))
                totals["train/micro_batches"] += 1
            max_norm = self.options.max_grad_norm or float("inf")
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
            grad_norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
            # the norm is every rank's (a collective): all of them stop here together, none waits for another
            if not math.isfinite(grad_norms[-1]):
                why = non_finite or f"the gradients of optimizer step {k + 1} have norm {grad_norms[-1]}"
                raise NonFiniteLoss(f"{why}; that optimizer step was not taken, so no weight holds NaN or inf")
            self.optimizer.step()
            self.scheduler.step()
            sums.append(dict(totals))
        return sums, grad_norms, lr

    def state_dict(self) -> dict[str, Any]:
        state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                 "steps_done": self.steps_done}
        if self.critic is not None:
            state["critic_optimizer"] = self.critic_optimizer.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.steps_done = state["steps_done"]
        if self.critic is not None:
            self.critic_optimizer.load_state_dict(state["critic_optimizer"])


# Figures every rank reports whole (not its share), so they are not summed over ranks.
_GLOBAL_KEYS = ("critic/grad_norm", "train/critic_warmup")
# Maxima: the largest over ranks and mini-batches
_MAX_KEYS = ("train/logprob_abs_diff_max",)


def sum_over_ranks(per_rank: list[list[dict[str, float]]]) -> list[dict[str, float]]:
    """Per mini-batch, each rank's metric sums added up (global figures taken from rank 0)."""
    out: list[dict[str, float]] = [{} for _ in per_rank[0]]
    for rank, sums in enumerate(per_rank):
        for k, totals in enumerate(sums):
            for key, value in totals.items():
                if key in _GLOBAL_KEYS:
                    out[k].setdefault(key, value)
                elif key in _MAX_KEYS:
                    out[k][key] = max(out[k].get(key, value), value)
                else:
                    out[k][key] = out[k].get(key, 0.0) + value
    return out


def combine_metrics(sums: list[dict[str, float]], norms: list[float], lr: float) -> dict[str, float]:
    """Average per-mini-batch metric sums (counts are added) and report the step's figures."""
    metrics: dict[str, float] = defaultdict(float)
    for totals in sums:
        for key, value in totals.items():
            if key in _MAX_KEYS:
                metrics[key] = max(metrics.get(key, value), value)
            else:
                metrics[key] += value if key in _COUNTS else value / len(sums)
    metrics.setdefault("train/clip_frac", 0.0)  # losses without clipping clip nothing
    metrics["train/grad_norm"] = sum(norms) / len(norms)
    metrics["train/lr"] = lr
    # optimizer steps on this batch; the last of them trained on samples from a policy that many steps minus one
    # older than itself (mini_batches x epochs: the staleness several passes add)
    metrics["train/optimizer_steps"] = float(len(norms))
    metrics["train/policy_lag_max"] = float(len(norms) - 1)
    return dict(metrics)


def assemble_rows(batch: TrainBatch, micros: list[list[int]], values: list[torch.Tensor]) -> torch.Tensor:
    """``[B, L-1]`` from per-micro-batch row values (each as wide as its micro-batch)."""
    out = torch.zeros(batch.loss_mask.shape, dtype=torch.float)
    for rows, tensor in zip(micros, values):
        if rows:
            out[rows, : tensor.shape[1]] = tensor
    return out


@takes_train_options
class TorchBackend:
    """Registered as backend ``torch``: the whole model in this process, on CPU or one GPU.

    Arguments: :class:`miles.train.options.TrainOptions`.
    """

    name = "torch"

    def __init__(self, **options: Any) -> None:
        self.options = TrainOptions(**options)
        check_kernel_name(self.options.logprob_kernel)
        self.policy: Policy | None = None

    def setup(self, model_path: str, *, seed: int, ref_model_path: str | None = None,
              total_steps: int | None = None, critic_model_path: str | None = None) -> None:
        torch.manual_seed(seed)
        device = resolve_device(self.options)
        model = hf.load_model(model_path)
        low_precision.quantized_training(model, qat=self.options.qat, precision=self.options.precision)
        if self.options.lora is not None:  # adapters initialised from the seeded RNG, before the move
            lora.apply_lora(model, self.options.lora)
        model = model.to(device).train()
        self._model_path = model_path
        ref = None if ref_model_path is None else hf.load_model(ref_model_path).to(device).eval().requires_grad_(False)
        critic = None if critic_model_path is None else hf.load_critic(critic_model_path).to(device).train()
        self.policy = Policy(model, self.options, device, ref, total_steps, self.build_optimizer(model), critic)

    def build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer | None:
        """Override to train with another optimizer; None means AdamW from the options."""
        return None

    @property
    def model(self) -> torch.nn.Module:
        return self.policy.model

    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        plan = plan_batch(batch, self.options, mini_batches=self.options.mini_batches, epochs=self.options.epochs)
        return combine_metrics(*self.policy.train(batch, [mini[0] for mini in plan], normalizers(batch.loss_mask, plan),
                                                  loss_fn))

    def compute_logprobs(self, batch: TrainBatch, reference: bool = False) -> torch.Tensor:
        micros = plan_batch(batch, self.options)[0][0]
        return assemble_rows(batch, micros, self.policy.logprobs(batch, micros, reference=reference))

    def ref_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self.compute_logprobs(batch, reference=True)

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        micros = plan_batch(batch, self.options)[0][0]
        return assemble_rows(batch, micros, self.policy.values(batch, micros))

    def export_weights(self) -> dict[str, torch.Tensor]:
        if self.options.lora is not None:  # merged full weights, or only the adapters (backend.lora.sync)
            return lora.export_weights(self.model, self.options.lora)
        return {name: tensor.detach().cpu() for name, tensor in self.model.state_dict().items()}

    def save_pretrained(self, path: str, tokenizer: Any = None, metadata: dict | None = None) -> None:
        if self.options.lora is not None:  # plain HF weights with the adapters merged in
            hf.save_state_dict(lora.merged_weights(self.model), self._model_path, path, tokenizer, metadata)
            return
        hf.save_pretrained(self.model, tokenizer, path, metadata, like=self._model_path)

    def save_checkpoint(self, path: str) -> None:
        path_ = Path(path)
        if self.options.lora is not None:  # the adapters only: the base is the model the run set up from
            from safetensors.torch import save_file

            (path_ / "model").mkdir(parents=True, exist_ok=True)
            save_file(lora.adapter_state(self.model.state_dict()), path_ / "model" / "adapters.safetensors")
        else:
            hf.save_pretrained(self.model, None, path_ / "model", like=self._model_path)
        critic = {} if self.policy.critic is None else {"critic": self.policy.critic.state_dict()}
        torch.save({**self.policy.state_dict(), **critic, "rng": rng_state()}, path_ / "trainer.pt")

    def load_checkpoint(self, path: str) -> None:
        from safetensors.torch import load_file

        path_ = Path(path)
        adapters = path_ / "model" / "adapters.safetensors"
        if adapters.is_file() != (self.options.lora is not None):
            held = "LoRA adapters" if adapters.is_file() else "full weights"
            raise ConfigError(f"run.resume: checkpoint {path} holds {held} but this run "
                              f"{'has no' if self.options.lora is None else 'has'} backend.lora; resume with the "
                              f"backend the checkpoint was saved with")
        if adapters.is_file():
            lora.load_adapter_state(self.model, load_file(adapters), f"checkpoint {path}")
            self._load_trainer_state(path_)
            return
        weights = {}
        for file in sorted((path_ / "model").glob("*.safetensors")):
            weights.update(load_file(file))
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        tied = {"lm_head.weight"} if self.model.config.tie_word_embeddings else set()
        if unexpected or set(missing) - tied:  # transformers renames some models' weights on save (Qwen2.5-VL)
            missing, unexpected = self.model.load_state_dict(hf.load_model(path_ / "model").state_dict(), strict=False)
        if unexpected or set(missing) - tied:
            raise ValueError(f"checkpoint {path}: weights do not fit the model (missing {sorted(set(missing) - tied)}, "
                             f"unexpected {sorted(unexpected)})")
        self._load_trainer_state(path_)

    def _load_trainer_state(self, path_: Path) -> None:
        state = torch.load(path_ / "trainer.pt", weights_only=False)
        if self.policy.critic is not None:
            self.policy.critic.load_state_dict(state["critic"])
        self.policy.load_state_dict(state)
        set_rng_state(state["rng"])

    def shutdown(self) -> None:
        self.policy = None
