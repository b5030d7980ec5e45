"""The training options every backend shares (the ``backend`` config node's arguments).

A backend class decorated with :func:`takes_train_options` accepts these as keyword arguments next
to its own, and the config validator sees them all in its signature, so a misspelt option is
reported before the run starts.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass
from typing import Any, Optional, Union

from miles.lazy import lazy_module
from miles.train.lora import parse_lora, require_peft
from miles.train.prefix_tree import parse_share_prefixes

torch = lazy_module("torch")

__all__ = ["TrainOptions", "takes_train_options", "resolve_device", "autocast_dtype"]

LR_SCHEDULES = ("constant", "linear", "cosine")
DTYPES = ("auto", "float32", "bfloat16")


@dataclass(frozen=True)
class TrainOptions:
    lr: float = 1e-3
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    max_grad_norm: float = 1.0  # 0 disables clipping (the norm is still reported)
    # Gradient accumulation: each optimizer step sums the gradients of its micro-batches, which hold at
    # most `micro_batch_size` samples, or, when `max_tokens_per_micro_batch` is set, at most that many
    # padded tokens (per worker). The loss is normalised by the whole batch, so the split never
    # changes the step.
    micro_batch_size: int = 256
    max_tokens_per_micro_batch: Optional[int] = None
    mini_batches: int = 1  # optimizer steps per training batch, each on an equal share of its samples
    # passes over the training batch (PPO epochs): mini_batches x epochs optimizer steps per rollout; every step after
    # the first trains on samples from a policy that many optimizer steps older (train/policy_lag_max)
    epochs: int = 1
    old_logprobs: str = "rollout"  # "rollout": the engine's log-probs; "recompute": a trainer forward pass
    lr_schedule: str = "constant"  # constant, linear or cosine decay to min_lr_ratio * lr over the run
    warmup_steps: int = 0  # linear warm-up from 0 over this many optimizer steps
    min_lr_ratio: float = 0.0
    critic_lr: Optional[float] = None  # the value model's learning rate (PPO); null: lr
    value_clip: Optional[float] = 0.2  # clip new values to old +- this in the value loss; null: no clipping
    critic_warmup_steps: int = 0  # train only the value model for the first steps of a PPO run
    device: str = "auto"  # auto: cuda when available, else cpu
    dtype: str = "auto"  # auto: bfloat16 autocast on a GPU that supports it, float32 on CPU
    # Log-probs and entropy over chunks of this many tokens, without the [tokens x vocab] fp32 logits (0: whole)
    logprob_chunk_tokens: int = 0
    logprob_kernel: str = "torch"  # the chunked path's kernel: torch (the reference), auto, or a registered name
    # Mixture-of-experts models: replay the rollout engine's expert choices (R3; samples need routed_experts),
    # and add router_aux_loss_coef x the router's load-balancing loss to the policy loss (0: off)
    routing_replay: bool = False
    router_aux_loss_coef: float = 0.0
    # LoRA through peft: {rank, alpha, target_modules, dropout, sync}; only the adapters train (null: off).
    # Read as miles.train.lora.LoraOptions; docs/lora.md
    lora: Optional[dict] = None
    # Log-probs one sequence at a time at the context length (miles.models.hf.exact_logprobs), as an engine with
    # exact_logprobs computes them: bit-identical to the rollout's (rollout.true_on_policy sets it; dense models)
    exact_logprobs: bool = False
    # Prefix-shared ("tree") training: rows of a micro-batch that share a prefix run it once, forward and backward
    # (auto: when that saves enough and the model takes a tree mask; true: always, refused for a model that cannot;
    # false: never). miles.train.prefix_tree; docs/backends.md
    share_prefixes: Union[str, bool] = "auto"
    # Vision-language models: keep the vision tower's weights as they are (only the language model trains); a
    # text-only model ignores it. docs/multimodal.md
    freeze_vision: bool = False
    # Quantization-aware training: a precision scheme (a builtin's name, {name, ...args}, or a scheme's spec) whose
    # engine numerics the training forward takes, with straight-through gradients (null: none). docs/precision.md
    qat: Union[str, dict, None] = None
    # Training in low precision: a precision scheme (mxfp8, nvfp4, fp8_block, ...) whose quantization every matmul of
    # the decoder's linear layers takes, forward and backward (emulated on CPU; master weights float32).
    precision: Union[str, dict, None] = None

    def __post_init__(self) -> None:
        problems = []
        for name in ("lr",):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("micro_batch_size", "mini_batches", "epochs"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch < 1:
            problems.append(f"max_tokens_per_micro_batch must be >= 1, got {self.max_tokens_per_micro_batch}")
        if self.logprob_chunk_tokens < 0:
            problems.append(f"logprob_chunk_tokens must be >= 0 (0: not chunked), got {self.logprob_chunk_tokens}")
        if self.exact_logprobs and (self.logprob_chunk_tokens or self.routing_replay or self.lora):
            problems.append("exact_logprobs (rollout.true_on_policy) computes log-probs one whole sequence at a time "
                            "for a dense model without adapters: it cannot go with logprob_chunk_tokens, "
                            "routing_replay or lora")
        if self.router_aux_loss_coef < 0:
            problems.append(f"router_aux_loss_coef must not be negative, got {self.router_aux_loss_coef}")
        if self.max_grad_norm < 0 or self.weight_decay < 0 or self.warmup_steps < 0 or self.critic_warmup_steps < 0:
            problems.append("max_grad_norm, weight_decay, warmup_steps and critic_warmup_steps must not be negative")
        if ((self.critic_lr is not None and self.critic_lr <= 0)
                or (self.value_clip is not None and self.value_clip <= 0)):
            problems.append("critic_lr and value_clip must be positive (or null)")
        if not 0 <= self.min_lr_ratio <= 1:
            problems.append(f"min_lr_ratio must be within [0, 1], got {self.min_lr_ratio}")
        if self.old_logprobs not in ("rollout", "recompute"):
            problems.append(f"old_logprobs must be 'rollout' (the engine's) or 'recompute' (a trainer forward pass), "
                            f"got {self.old_logprobs!r}")
        if self.lr_schedule not in LR_SCHEDULES:
            problems.append(f"lr_schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}")
        if self.dtype not in DTYPES:
            problems.append(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            problems.append(f"device must be auto, cpu or cuda, got {self.device!r}")
        try:
            object.__setattr__(self, "share_prefixes", parse_share_prefixes(self.share_prefixes))
        except ValueError as exc:
            problems.append(str(exc))
        if self.exact_logprobs and self.share_prefixes == "true":
            problems.append("exact_logprobs (rollout.true_on_policy) computes each row alone, bit-identical to the "
                            "engine: it cannot go with share_prefixes true (auto does not share under it)")
        try:
            object.__setattr__(self, "lora", parse_lora(self.lora))
        except ValueError as exc:
            problems.append(str(exc))
        for key in ("qat", "precision"):
            try:
                object.__setattr__(self, key, parse_scheme(getattr(self, key), key))
            except ValueError as exc:
                problems.append(str(exc))
            if getattr(self, key) is not None and self.lora is not None:
                problems.append(f"{key} quantizes the model's own linear layers; it cannot go with lora (whose "
                                f"adapters the engine merges into quantized weights it cannot hold)")
        if isinstance(self.precision, dict):  # parsed: a scheme's spec
            from miles.precision.schemes import from_spec

            if (scheme := from_spec(self.precision)).weight_only:
                problems.append(f"precision: {scheme.name} quantizes weights only; training in low precision "
                                f"quantizes every operand: use mxfp8, nvfp4, fp8_block or fp8_channel (or qat: "
                                f"{scheme.name} to train on what its engine serves)")
        if self.qat is not None and self.precision is not None:
            problems.append("qat and precision both quantize the training forward: precision already computes it as "
                            "the engine under the same scheme does; set one of them")
        if problems:
            raise ValueError("; ".join(problems))
        if self.lora is not None:
            require_peft()  # a ConfigError naming the extra to install

    def lr_factor(self, step: int, total_steps: int | None) -> float:
        """The multiplier of ``lr`` for optimizer step ``step`` (0-based) of ``total_steps``."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.lr_schedule == "constant" or not total_steps:
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / max(1, total_steps - self.warmup_steps))
        if self.lr_schedule == "linear":
            decay = 1.0 - progress
        else:
            decay = 0.5 * (1.0 + math.cos(progress * math.pi))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * decay


def parse_scheme(value: Any, key: str) -> dict[str, Any] | None:
    """``backend.qat`` or ``backend.precision`` as a scheme's spec (None: none): a builtin scheme's name,
    ``{name: ..., <its arguments>}``, or a spec (``{path, args}``, what Miles passes once it has resolved a registered
    name)."""
    from miles.precision.schemes import BUILTIN_SCHEMES, from_spec

    if value is None or value == "bf16":
        return None
    node = {"name": value} if isinstance(value, str) else value
    try:
        if isinstance(node, dict) and "path" in node:
            from_spec(node)  # a ValueError naming what is wrong
            return dict(node)
        if isinstance(node, dict) and node.get("name") in BUILTIN_SCHEMES:
            return BUILTIN_SCHEMES[node["name"]](**{k: v for k, v in node.items() if k != "name"}).spec()
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{key}: {exc}") from exc
    raise ValueError(f"{key}: expected a precision scheme ({', '.join(BUILTIN_SCHEMES)}) or null, got {value!r}")


class _OwnSignature:
    """A class's ``__signature__`` that its subclasses do not inherit (they are inspected as usual)."""

    def __init__(self, owner: type, signature: inspect.Signature) -> None:
        self.owner, self.signature = owner, signature

    def __get__(self, obj: object, objtype: type | None = None) -> inspect.Signature | None:
        return self.signature if obj is None and objtype is self.owner else None


def takes_train_options(cls: type) -> type:
    """Give ``cls.__init__(self, <own args>, **options)`` a signature listing every option by name."""
    own = [p for p in inspect.signature(cls.__init__).parameters.values()
           if p.name != "self" and p.kind is not p.VAR_KEYWORD]
    options = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
               for f in dataclasses.fields(TrainOptions)]
    cls.__signature__ = _OwnSignature(cls, inspect.Signature(own + options))
    return cls


def resolve_device(options: TrainOptions) -> torch.device:
    if options.device == "cuda" or (options.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("backend.device is 'cuda' but torch sees no GPU")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def autocast_dtype(options: TrainOptions, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for forward passes (weights and optimizer stay float32), or None."""
    if options.dtype == "float32":
        return None
    supported = device.type == "cuda" and torch.cuda.is_bf16_supported()
    if options.dtype == "bfloat16" and not supported:
        raise ValueError(f"dtype bfloat16 needs a GPU with bf16 support; this backend runs on {device.type}: "
                         f"use dtype float32 (or auto)")
    return torch.bfloat16 if supported else None
