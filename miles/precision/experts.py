"""Mixture-of-experts layers in a precision scheme: the experts of a transformers MoE block hold their weights as 3-D
parameters, ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``; a scheme quantizes each expert's matrix as it
quantizes a linear layer's weight, and the stored tensors are stacked over the experts.

A target is named by the parameter (``model.layers.3.mlp.experts.gate_up_proj``); its stored tensors are named after
it as a linear layer's are after ``weight`` (``..._scale_inv``, ``..._packed``, ``..._scale`` ...). The experts'
forward is the eager one of transformers (each expert's tokens through ``gate_up_proj``, the activation, then
``down_proj``, weighted by the router), with each matmul computed as the scheme says: the engine's
(:class:`QuantizedExperts`), QAT's (straight-through) or low-precision training's. The router stays in high
precision, and routing replay (R3) is unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from miles.lazy import lazy_module
from miles.precision.schemes import Scheme

torch = lazy_module("torch")

__all__ = ["EXPERT_PARAMS", "expert_targets", "is_experts", "stored_name", "quantize_stack", "dequantize_stack",
           "missing_experts", "fuse_per_expert", "QuantizedExperts", "experts_forward"]

EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def is_experts(module: Any) -> bool:
    """A transformers experts block: 3-D ``gate_up_proj`` and ``down_proj``, an activation, no biases."""
    params = dict(module.named_parameters(recurse=False))
    return (all(p in params and params[p].dim() == 3 for p in EXPERT_PARAMS) and set(params) == set(EXPERT_PARAMS)
            and hasattr(module, "act_fn") and hasattr(module, "num_experts"))


def expert_targets(name: str, module: Any) -> list[str]:
    return [f"{name}.{p}" for p in EXPERT_PARAMS] if is_experts(module) or isinstance(module, QuantizedExperts) else []


def stored_name(param: str, suffix: str) -> str:
    """The stored tensor ``suffix`` (``weight``, ``weight_scale_inv`` ...) of expert parameter ``param``."""
    return param + suffix.removeprefix("weight")


def quantize_stack(scheme: Scheme, weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each expert's ``[out, in]`` matrix quantized, each stored tensor stacked over the experts (by suffix)."""
    per_expert = [scheme.quantize(w) for w in weights]
    return {suffix: torch.stack([stored[suffix] for stored in per_expert]) for suffix in scheme.stored}


def dequantize_stack(scheme: Scheme, stored: Mapping[str, torch.Tensor]) -> torch.Tensor:
    experts = next(iter(stored.values())).shape[0]
    return torch.stack([scheme.dequantize({s: t[e] for s, t in stored.items()}) for e in range(experts)])


_ONE_EXPERT = re.compile(r"(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
PER_EXPERT = ("gate_proj", "up_proj", "down_proj")


def missing_experts(names: Iterable[str]) -> str | None:
    """What a checkpoint that publishes the experts one layer each (``<block>.<e>.gate_proj.weight``, as Qwen3-MoE
    and DeepSeek checkpoints name them) lacks, in words, or None: every expert of a block, up to the highest index
    it names, has its ``gate_proj``, ``up_proj`` and ``down_proj``."""
    names = set(names)
    blocks: dict[str, int] = {}
    for name in names:
        if found := _ONE_EXPERT.match(name):
            blocks[found[1]] = max(blocks.get(found[1], 0), int(found[2]) + 1)
    missing = [f"{block}.{e}.{part}.weight" for block, count in blocks.items() for e in range(count)
               for part in PER_EXPERT if f"{block}.{e}.{part}.weight" not in names]
    if not missing:
        return None
    return (f"{', '.join(sorted(missing)[:8])} missing: a checkpoint that holds the experts one layer each has "
            f"{', '.join(PER_EXPERT)} for every expert")


def fuse_per_expert(weights: dict[str, torch.Tensor], model: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's float weights with the experts published one layer each stacked into the block parameters of
    ``model`` (its state dict): ``<block>.gate_up_proj [E, 2I, H]``, each expert's gate rows then its up rows, and
    ``<block>.down_proj [E, H, I]``, as transformers' own conversion fuses them. Blocks the checkpoint holds fused
    are left as they are. A ValueError says what is missing, or which block holds another number of experts."""
    if problem := missing_experts(weights):
        raise ValueError(problem)
    counts: dict[str, int] = {}  # block -> experts it holds one layer each
    for name in weights:
        if (found := _ONE_EXPERT.match(name)) and found[3] == "down_proj":
            counts[found[1]] = counts.get(found[1], 0) + 1
    out = dict(weights)
    for key, like in model.items():
        block, _, param = key.rpartition(".")
        if param not in EXPERT_PARAMS or key in weights or not (count := counts.get(block, 0)):
            continue
        parts = ("gate_proj", "up_proj") if param == "gate_up_proj" else ("down_proj",)
        if count != like.shape[0]:
            raise ValueError(f"{block}: the checkpoint holds {count} experts one layer each, the model has "
                             f"{like.shape[0]} (its config's number of experts)")
        out[key] = torch.stack([torch.cat([out.pop(f"{block}.{e}.{part}.weight") for part in parts])
                                for e in range(count)])
    return out


def experts_forward(module: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor, linear: Callable[[torch.Tensor, str, int], torch.Tensor]
                    ) -> torch.Tensor:
    """transformers' eager experts forward, with ``linear(x, param, expert)`` for each matmul."""
    final = torch.zeros_like(hidden_states)
    with torch.no_grad():
        mask = torch.nn.functional.one_hot(top_k_index, num_classes=module.num_experts + 1).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert in hit:
        expert = int(expert[0])
        if expert == module.num_experts:
            continue
        slot, token = torch.where(mask[expert])
        gate, up = linear(hidden_states[token], "gate_up_proj", expert).chunk(2, dim=-1)
        out = linear(module.act_fn(gate) * up, "down_proj", expert) * top_k_weights[token, slot, None]
        final.index_add_(0, token, out.to(final.dtype))
    return final


class QuantizedExperts(torch.nn.Module):
    """An experts block holding ``gate_up_proj`` and ``down_proj`` in a scheme's stored form (buffers named as
    :func:`stored_name` says), computing as the scheme says; the dequantized weights are kept until an update."""

    def __init__(self, experts: Any, scheme: Scheme) -> None:
        super().__init__()
        self.scheme, self.num_experts, self.act_fn = scheme, experts.num_experts, experts.act_fn
        for param in EXPERT_PARAMS:
            for suffix, tensor in quantize_stack(scheme, getattr(experts, param).detach()).items():
                self.register_buffer(stored_name(param, suffix), tensor.to(getattr(experts, param).device))
        self._cache: dict[str, tuple[tuple[Any, ...], torch.Tensor]] = {}

    def stored(self, param: str) -> dict[str, torch.Tensor]:
        return {suffix: getattr(self, stored_name(param, suffix)) for suffix in self.scheme.stored}

    def dequantized(self, param: str) -> torch.Tensor:
        tensors = self.stored(param)
        key = tuple((t.data_ptr(), t._version) for t in tensors.values())
        if param not in self._cache or self._cache[param][0] != key:
            self._cache[param] = (key, dequantize_stack(self.scheme, tensors))
        return self._cache[param][1]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        def linear(x: torch.Tensor, param: str, expert: int) -> torch.Tensor:
            weight = self.dequantized(param)[expert].to(x.dtype)
            return torch.nn.functional.linear(self.scheme.activation(x), weight)

        return experts_forward(self, hidden_states, top_k_index, top_k_weights, linear)
