"""Weights between HF and Megatron layouts, by the rules of :mod:`miles_megatron.arch`.

Two steps each way, all exact (only slicing, concatenation and reshaping):

- :func:`hf_to_megatron` / :func:`megatron_to_hf`: HF names <-> the full (unsharded) Megatron state
  (experts by global index);
- :func:`shard` / :func:`unshard`: the full Megatron state <-> one rank's tensor- and
  expert-parallel share (vocabulary padded to a multiple of the tensor-parallel size; experts renumbered
  from 0 on each expert-parallel rank).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import torch

from miles_megatron.arch import ModelSpec, Rule

__all__ = ["hf_to_megatron", "megatron_to_hf", "shard", "unshard", "padded_vocab", "rule_of"]

Tensor = torch.Tensor


def padded_vocab(vocab_size: int, tp_size: int) -> int:
    """The vocabulary rows each model holds: the next multiple of the tensor-parallel size."""
    return math.ceil(vocab_size / tp_size) * tp_size


def _layers(spec: ModelSpec) -> list[int | None]:
    return [None, *range(spec.num_layers)]


def _fuse_qkv(q: Tensor, k: Tensor, v: Tensor, spec: ModelSpec) -> Tensor:
    groups, per_group, dim = spec.num_query_groups, spec.num_heads // spec.num_query_groups, spec.head_dim
    rest = q.shape[1:]
    parts = (q.reshape(groups, per_group * dim, *rest), k.reshape(groups, dim, *rest), v.reshape(groups, dim, *rest))
    return torch.cat(parts, dim=1).reshape(groups * (per_group + 2) * dim, *rest)


def _split_qkv(qkv: Tensor, spec: ModelSpec) -> tuple[Tensor, Tensor, Tensor]:
    groups, per_group, dim = spec.num_query_groups, spec.num_heads // spec.num_query_groups, spec.head_dim
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(groups, (per_group + 2) * dim, *rest).split([per_group * dim, dim, dim], dim=1)
    return (q.reshape(groups * per_group * dim, *rest).contiguous(), k.reshape(groups * dim, *rest).contiguous(),
            v.reshape(groups * dim, *rest).contiguous())


def hf_to_megatron(hf: Mapping[str, Tensor], spec: ModelSpec) -> dict[str, Tensor]:
    """The full Megatron state of an HF state dict (every HF weight must be used)."""
    out: dict[str, Tensor] = {}
    used: set[str] = set()
    for layer in _layers(spec):
        for rule in spec.rules_for(layer):
            names = [name.format(layer=layer) for name in rule.hf]
            missing = [name for name in names if name not in hf]
            if missing:
                raise KeyError(f"HF weights lack {missing} "
                               f"(for Megatron {rule.megatron.format(layer=layer, expert='*')})")
            used.update(names)
            tensors = [hf[name] for name in names]
            target = rule.megatron.replace("{layer}", str(layer))
            if rule.join == "copy":
                out[target] = tensors[0].clone()
            elif rule.join == "qkv":
                out[target] = _fuse_qkv(*tensors, spec)
            elif rule.join == "gate_up":
                out[target] = torch.cat(tensors, dim=0)
            else:  # stacked experts
                if tensors[0].shape[0] != spec.num_experts:
                    raise ValueError(f"{names[0]}: expected {spec.num_experts} experts along dimension 0, "
                                     f"got shape {tuple(tensors[0].shape)}")
                for expert in range(spec.num_experts):
                    out[target.format(expert=expert)] = tensors[0][expert].clone()
    if spec.tied:
        used.add("lm_head.weight")
    unused = sorted(set(hf) - used)
    if unused:
        raise KeyError(f"HF weights not covered by the architecture map: {unused[:8]}")
    return out


def megatron_to_hf(full: Mapping[str, Tensor], spec: ModelSpec) -> dict[str, Tensor]:
    """HF weights (``transformers`` in-memory names) from the full Megatron state."""
    out: dict[str, Tensor] = {}
    for layer in _layers(spec):
        for rule in spec.rules_for(layer):
            names = [name.format(layer=layer) for name in rule.hf]
            source = rule.megatron.replace("{layer}", str(layer))
            if rule.join == "stacked":
                out[names[0]] = torch.stack([full[source.format(expert=e)] for e in range(spec.num_experts)])
            elif rule.join == "qkv":
                out.update(zip(names, _split_qkv(full[source], spec)))
            elif rule.join == "gate_up":
                out.update(zip(names, (t.contiguous() for t in full[source].chunk(2, dim=0))))
            else:
                out[names[0]] = full[source].clone()
    if spec.tied:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def _patterns(spec: ModelSpec) -> list[tuple[re.Pattern[str], Rule]]:
    patterns = []
    for rule in spec.arch.rules:
        regex = (re.escape(rule.megatron).replace(r"\{layer\}", r"(?P<layer>\d+)")
                 .replace(r"\{expert\}", r"(?P<expert>\d+)"))
        patterns.append((re.compile(regex + "$"), rule))
    return patterns


def rule_of(name: str, spec: ModelSpec) -> tuple[Rule, int | None]:
    """The rule a Megatron parameter name falls under, and its expert index (None outside experts)."""
    for pattern, rule in _patterns(spec):
        match = pattern.match(name)
        if match:
            expert = match.groupdict().get("expert")
            return rule, None if expert is None else int(expert)
    raise KeyError(f"Megatron parameter {name!r} is not in the architecture map")


def _expert_name(name: str, expert: int) -> str:
    return re.sub(r"local_experts\.\d+\.", f"local_experts.{expert}.", name)


def _split(tensor: Tensor, rule: Rule, tp_size: int, tp_rank: int) -> Tensor:
    if rule.join == "gate_up":
        return torch.cat([half.chunk(tp_size, dim=0)[tp_rank] for half in tensor.chunk(2, dim=0)]).contiguous()
    return tensor.chunk(tp_size, dim=rule.tp_dim)[tp_rank].contiguous()


def shard(full: Mapping[str, Tensor], spec: ModelSpec, *, tp_size: int = 1, tp_rank: int = 0, ep_size: int = 1,
          ep_rank: int = 0) -> dict[str, Tensor]:
    """One rank's share of the full Megatron state."""
    per_rank = spec.num_experts // ep_size if spec.num_experts else 0
    out: dict[str, Tensor] = {}
    for name, tensor in full.items():
        rule, expert = rule_of(name, spec)
        if expert is not None:
            if expert // per_rank != ep_rank:
                continue
            name = _expert_name(name, expert - ep_rank * per_rank)
        if rule.vocab and tensor.shape[0] != padded_vocab(tensor.shape[0], tp_size):
            pad = padded_vocab(tensor.shape[0], tp_size) - tensor.shape[0]
            tensor = torch.cat([tensor, tensor.new_zeros(pad, *tensor.shape[1:])])
        out[name] = tensor.clone() if rule.tp_dim is None or tp_size == 1 else _split(tensor, rule, tp_size, tp_rank)
    return out


def unshard(shards: Mapping[tuple[int, int], Mapping[str, Tensor]], spec: ModelSpec, *, tp_size: int = 1,
            ep_size: int = 1) -> dict[str, Tensor]:
    """The full Megatron state from every rank's share (``shards[(tp_rank, ep_rank)]``)."""
    per_rank = spec.num_experts // ep_size if spec.num_experts else 0
    out: dict[str, Tensor] = {}
    for ep_rank in range(ep_size):
        for name in shards[(0, ep_rank)]:
            rule, expert = rule_of(name, spec)
            if expert is None and ep_rank > 0:
                continue  # the same on every expert-parallel rank
            parts = [shards[(tp_rank, ep_rank)][name] for tp_rank in range(tp_size)]
            if rule.tp_dim is None or tp_size == 1:
                tensor = parts[0]
            elif rule.join == "gate_up":
                halves = [part.chunk(2, dim=0) for part in parts]
                tensor = torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
            else:
                tensor = torch.cat(parts, dim=rule.tp_dim)
            if rule.vocab:
                tensor = tensor[: spec.vocab_size]
            if expert is not None:
                name = _expert_name(name, expert + ep_rank * per_rank)
            out[name] = tensor.contiguous()
    return out
