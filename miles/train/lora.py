"""LoRA through peft (``backend.lora``): adapters injected into the HF model, only they train.

:func:`apply_lora` injects peft's LoRA layers into the model in place (``peft.inject_adapter_in_model``: the
model stays the ``transformers`` class, so log-prob chunking, MoE routing and FSDP2 sharding see the same
modules) and freezes every other parameter. Exports speak HF names without peft's prefixes:
:func:`merged_weights` (``W + alpha/rank * B @ A``: what engines load and ``save_pretrained`` writes) and
:func:`adapter_weights` (the adapter payload of :mod:`miles.weights.lora`, for ``sync: adapters``).
Checkpoints hold :func:`adapter_state` (peft's own parameter names) and the adapters' optimizer state.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from miles.errors import ConfigError
from miles.lazy import lazy_module
from miles.weights.lora import is_adapter_payload, merge_adapters

torch = lazy_module("torch")

__all__ = ["LoraOptions", "parse_lora", "require_peft", "apply_lora", "check_targets", "is_lora_model",
           "trainable_parameters", "base_weights", "adapter_weights", "merged_weights", "export_weights",
           "adapter_state", "load_adapter_state", "merge_adapters", "is_adapter_payload"]

ADAPTER = "default"  # peft's adapter name; one adapter per model
SYNC_MODES = ("merged", "adapters")
_KEYS = ("rank", "alpha", "target_modules", "dropout", "sync")


@dataclass(frozen=True)
class LoraOptions:
    """``backend.lora``: adapters of ``rank`` on ``target_modules`` (peft's matching: a list of module-name
    suffixes, or one regular expression, or ``all-linear``: every linear layer but the output layer), scaled by
    ``alpha / rank``; ``sync``: what weight sync sends, merged full weights or only the adapters."""

    rank: int
    alpha: float | None = None  # null: rank (scaling 1)
    target_modules: str | tuple[str, ...] = "all-linear"
    dropout: float = 0.0
    sync: str = "merged"

    @property
    def scaling(self) -> float:
        return (self.rank if self.alpha is None else self.alpha) / self.rank


def parse_lora(value: Any) -> LoraOptions | None:
    """``backend.lora`` (None, a mapping or :class:`LoraOptions`) as options; a ValueError names every bad key
    (``backend.lora.<key>``) and what it expected."""
    if value is None or isinstance(value, LoraOptions):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"backend.lora: expected a mapping {{rank, alpha, target_modules, dropout, sync}} "
                         f"(or null: no LoRA), got {value!r}")
    problems = []
    for key in value:
        if key not in _KEYS:
            close = difflib.get_close_matches(str(key), _KEYS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            problems.append(f"backend.lora.{key}: unknown key (known: {', '.join(_KEYS)}){hint}")
    rank = value.get("rank")
    if rank is None:
        problems.append("backend.lora.rank: missing; expected the adapters' rank, an integer >= 1 (e.g. 8)")
    elif isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        problems.append(f"backend.lora.rank: expected an integer >= 1, got {rank!r}")
    alpha = value.get("alpha")
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0):
        problems.append(f"backend.lora.alpha: expected a positive number (the scaling is alpha / rank) or null "
                        f"(alpha = rank), got {alpha!r}")
    targets = value.get("target_modules", "all-linear")
    if isinstance(targets, str):
        if not targets:
            problems.append("backend.lora.target_modules: expected module names, a regular expression or "
                            "'all-linear', got ''")
    elif not isinstance(targets, (list, tuple)) or not targets or not all(isinstance(t, str) and t for t in targets):
        problems.append(f"backend.lora.target_modules: expected a non-empty list of module names (e.g. [q_proj, "
                        f"v_proj]), a regular expression or 'all-linear', got {targets!r}")
    dropout = value.get("dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        problems.append(f"backend.lora.dropout: expected a number within [0, 1), got {dropout!r}")
    sync = value.get("sync", "merged")
    if sync not in SYNC_MODES:
        problems.append(f"backend.lora.sync: expected merged (engines get merged full weights) or adapters (only the "
                        f"adapters travel; the engine merges them), got {sync!r}")
    if problems:
        raise ValueError("; ".join(problems))
    return LoraOptions(rank=rank, alpha=None if alpha is None else float(alpha),
                       target_modules=targets if isinstance(targets, str) else tuple(targets),
                       dropout=float(dropout), sync=sync)


def require_peft() -> Any:
    """The ``peft`` module, or a ConfigError that names the extra to install."""
    try:
        import peft
    except ImportError as exc:
        raise ConfigError(f"backend.lora needs peft, which is not importable here ({exc}): pip install "
                          f"'miles[lora]' (or pip install peft==0.21.2)") from None
    return peft


def _config(options: LoraOptions) -> Any:
    peft = require_peft()
    targets = options.target_modules
    return peft.LoraConfig(r=options.rank, lora_alpha=options.rank if options.alpha is None else options.alpha,
                           target_modules=targets if isinstance(targets, str) else list(targets),
                           lora_dropout=options.dropout, bias="none")


def _lora_layers(model: torch.nn.Module) -> list[tuple[str, Any]]:
    from peft.tuners.lora import LoraLayer

    return [(name, module) for name, module in model.named_modules() if isinstance(module, LoraLayer)]


def apply_lora(model: torch.nn.Module, options: LoraOptions) -> torch.nn.Module:
    """Inject LoRA layers into ``model`` (in place; returned) and freeze everything else.

    Only linear layers (``nn.Linear``, GPT-2's ``Conv1D``) can be adapted: a ConfigError names
    ``backend.lora.target_modules`` when the targets match nothing or something else."""
    peft = require_peft()
    try:
        peft.inject_adapter_in_model(_config(options), model, adapter_name=ADAPTER)
    except ValueError as exc:
        targets = options.target_modules if isinstance(options.target_modules, str) else list(options.target_modules)
        raise ConfigError(f"backend.lora.target_modules: {targets!r} does not fit this model: {exc}") from None
    other = [name for name, module in _lora_layers(model) if not isinstance(module, peft.tuners.lora.Linear)]
    if other:
        raise ConfigError(f"backend.lora.target_modules: only linear layers can be adapted; these are not: "
                          f"{', '.join(other[:8])}")
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_A." in name or ".lora_B." in name)
    return model


def check_targets(model_path: str, options: LoraOptions) -> None:
    """Apply LoRA to the model of ``model_path`` built on the meta device (no weights read): the same
    ConfigErrors as :func:`apply_lora`, before workers start."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    apply_lora(model, options)


def is_lora_model(model: torch.nn.Module) -> bool:
    return bool(_lora_layers(model))


def trainable_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters that train (with LoRA: the adapters), by name."""
    return [(name, param) for name, param in model.named_parameters() if param.requires_grad]


def _hf_name(name: str) -> str:
    return name.replace(".base_layer.", ".")


def _is_adapter_key(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def base_weights(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base model's weights by HF name, from a state dict of a model with LoRA layers (adapters left out)."""
    return {_hf_name(name): tensor for name, tensor in state.items() if not _is_adapter_key(name)}


def adapter_weights(model: torch.nn.Module, state: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The adapter payload (:mod:`miles.weights.lora`) of ``model``'s LoRA layers, read from ``state`` (e.g. a
    full state dict gathered from shards) or the model itself; tensors detached, on CPU."""
    state = model.state_dict() if state is None else state
    out: dict[str, torch.Tensor] = {}
    for name, layer in _lora_layers(model):
        a = state[f"{name}.lora_A.{ADAPTER}.weight"].detach().cpu()
        b = state[f"{name}.lora_B.{ADAPTER}.weight"].detach().cpu()
        if layer.fan_in_fan_out:  # the weight is stored [in, out]: (B @ A).T = A.T @ B.T
            a, b = b.t().contiguous(), a.t().contiguous()
        out[f"{name}.lora_A.weight"], out[f"{name}.lora_B.weight"] = a, b
        out[f"{name}.lora_scaling"] = torch.tensor([float(layer.scaling[ADAPTER])], dtype=torch.float32)
    return out


def merged_weights(model: torch.nn.Module, state: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Full weights by HF name with every adapter merged in (``W + alpha/rank * B @ A``), on CPU."""
    state = model.state_dict() if state is None else state
    base = {name: tensor.detach().cpu() for name, tensor in base_weights(state).items()}
    return merge_adapters(base, adapter_weights(model, state))


def export_weights(model: torch.nn.Module, options: LoraOptions,
                   state: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """What weight sync sends: the adapter payload with ``sync: adapters``, else the merged weights."""
    return adapter_weights(model, state) if options.sync == "adapters" else merged_weights(model, state)


def adapter_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors of a state dict, under peft's names (what a checkpoint holds)."""
    return {name: tensor.detach().cpu().contiguous() for name, tensor in state.items() if _is_adapter_key(name)}


def load_adapter_state(model: torch.nn.Module, adapters: Mapping[str, torch.Tensor], where: str,
                       load: Callable[[Mapping[str, torch.Tensor]], Any] | None = None) -> None:
    """Load checkpointed adapters into ``model`` (``load``: how, for sharded models; default
    ``model.load_state_dict(..., strict=False)``); a ConfigError when they do not fit its LoRA layers."""
    expected = {name: param for name, param in model.state_dict().items() if _is_adapter_key(name)}
    missing = sorted(set(expected) - set(adapters))
    unexpected = sorted(set(adapters) - set(expected))
    shapes = [f"{n} (got {tuple(adapters[n].shape)}, expected {tuple(p.shape)})" for n, p in expected.items()
              if n in adapters and tuple(adapters[n].shape) != tuple(p.shape)]
    if missing or unexpected or shapes:
        raise ConfigError(f"{where}: the checkpoint's adapters do not fit backend.lora (missing {missing[:4]}, "
                          f"unexpected {unexpected[:4]}, wrong shape {shapes[:4]}); resume with the backend.lora "
                          f"(rank, target_modules) the run was saved with")
    if load is None:
        model.load_state_dict(dict(adapters), strict=False)
    else:
        load(adapters)
