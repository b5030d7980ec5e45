"""A model's linear layers in a precision scheme: which layers, the engine's quantized layer, and the conversions of a
weight dict between its float form (what the trainer holds) and its stored form (what the engine holds).

By default a scheme applies to every ``nn.Linear`` of the decoder's layers (``layers.<i>.``): attention and MLP
projections, and the experts of an MoE block (named by their 3-D parameters: :mod:`miles.precision.experts`).
Embeddings, norms, the MoE router, the output layer and a vision tower stay in high precision, as the published FP8
and INT4 checkpoints keep them; ``include``/``exclude`` (substrings of module names) change that.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from miles.lazy import lazy_module
from miles.precision import experts
from miles.precision.schemes import Scheme

torch = lazy_module("torch")

__all__ = ["QuantizedLinear", "target_modules", "shape_problems", "quantize_model", "quantize_weights",
           "dequantize_weights", "weight_bytes"]

_DECODER_LAYER = re.compile(r"(^|\.)layers\.\d+\.")
_NEVER = ("visual", "vision_tower", "lm_head", "embed")


def target_modules(model: Any, include: Sequence[str] = (), exclude: Sequence[str] = ()) -> list[str]:
    """The qualified names of the layers a scheme applies to, in the model's order: by default every ``nn.Linear``
    inside a decoder layer and the experts' parameters of each MoE block there; with ``include``, those whose name
    contains one of its strings; never one whose name contains a string of ``exclude``."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Linear, QuantizedLinear)):
            candidates = [name]
        else:
            candidates = experts.expert_targets(name, module)
        for candidate in candidates:
            chosen = any(s in candidate for s in include) if include else (
                bool(_DECODER_LAYER.search(candidate)) and not any(s in candidate for s in _NEVER))
            if chosen and not any(s in candidate for s in exclude):
                names.append(candidate)
    return names


def _is_expert(name: str) -> bool:
    """An experts block's stacked parameter (``...mlp.experts.down_proj``), not one expert's own layer
    (``...mlp.experts.3.down_proj``, as checkpoints published per expert name them)."""
    owner, _, param = name.rpartition(".")
    return param in experts.EXPERT_PARAMS and owner.endswith(".experts")


def shape_problems(model: Any, scheme: Scheme, names: Iterable[str]) -> list[str]:
    """``<module> [out, in]: why`` for each named layer whose weight the scheme cannot take."""
    modules = dict(model.named_modules())
    problems = []
    for name in names:
        if _is_expert(name):  # each expert's matrix
            owner, _, param = name.rpartition(".")
            shape = tuple(getattr(modules[owner], param).shape[1:])
        else:
            shape = (modules[name].out_features, modules[name].in_features)
        if (why := scheme.check(shape)) is not None:
            problems.append(f"{name} {list(shape)}: {why}")
    return problems


class QuantizedLinear(torch.nn.Module):
    """A linear layer whose weight is held in a scheme's stored form (buffers named as the checkpoint names them, so
    that the model's state dict is the stored form) and computed with as the scheme says: the input quantized
    (``scheme.activation``), the weight dequantized, a float matmul. The dequantized weight is kept until the stored
    tensors change (a weight update copies into them)."""

    def __init__(self, scheme: Scheme, stored: Mapping[str, torch.Tensor], bias: torch.Tensor | None,
                 in_features: int, out_features: int) -> None:
        super().__init__()
        self.scheme, self.in_features, self.out_features = scheme, in_features, out_features
        self._stored = tuple(stored)
        for name, tensor in stored.items():
            self.register_buffer(name, tensor)
        self.bias = torch.nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self._cache: tuple[tuple[Any, ...], torch.Tensor] | None = None

    @classmethod
    def from_linear(cls, linear: Any, scheme: Scheme) -> QuantizedLinear:
        stored = scheme.quantize(linear.weight.detach())
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        return cls(scheme, stored, bias, linear.in_features, linear.out_features).to(linear.weight.device)

    def stored(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self._stored}

    def dequantized(self) -> torch.Tensor:
        tensors = self.stored()
        key = tuple((t.data_ptr(), t._version) for t in tensors.values())
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, self.scheme.dequantize(tensors))
        return self._cache[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.dequantized().to(x.dtype)
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return torch.nn.functional.linear(self.scheme.activation(x), weight, bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.describe()}"


def quantize_model(model: Any, scheme: Scheme, names: Sequence[str]) -> None:
    """Replace each named ``nn.Linear`` of ``model`` by a :class:`QuantizedLinear` holding its weight's stored form
    (what an engine does once it has loaded float weights)."""
    for name in names:
        if _is_expert(name):
            name = name.rpartition(".")[0]  # the experts block, replaced once for both of its parameters
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        module = getattr(parent, child)
        if isinstance(module, torch.nn.Linear):
            setattr(parent, child, QuantizedLinear.from_linear(module, scheme))
        elif experts.is_experts(module):
            setattr(parent, child, experts.QuantizedExperts(module, scheme))


def quantize_weights(weights: Mapping[str, torch.Tensor], scheme: Scheme,
                     names: Sequence[str]) -> dict[str, torch.Tensor]:
    """A float state dict with each named layer's ``<name>.weight`` replaced by its stored tensors, in place (the
    dict's order otherwise kept): what the trainer sends to engines that hold the stored form."""
    targets = set(names)
    out: dict[str, torch.Tensor] = {}
    for key, tensor in weights.items():
        module, _, leaf = key.rpartition(".")
        if leaf == "weight" and module in targets:
            for suffix, stored in scheme.quantize(tensor).items():
                out[f"{module}.{suffix}"] = stored
        elif key in targets:  # an experts parameter: every expert's matrix, stacked
            for suffix, stored in experts.quantize_stack(scheme, tensor).items():
                out[experts.stored_name(key, suffix)] = stored
        else:
            out[key] = tensor
    return out


def dequantize_weights(weights: Mapping[str, torch.Tensor], scheme: Scheme,
                       names: Sequence[str]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`quantize_weights`: each named layer's stored tensors replaced by its float32 weight
    (``<name>.weight``, or the experts' parameter). A layer with a stored tensor missing is a ValueError naming it."""
    owner: dict[str, tuple[str, str]] = {}  # stored tensor name -> (target, suffix)
    for name in names:
        for suffix in scheme.stored:
            owner[_stored_key(name, suffix)] = (name, suffix)
    out: dict[str, torch.Tensor] = {}
    for key, tensor in weights.items():
        if key not in owner:
            out[key] = tensor
            continue
        name, _ = owner[key]
        float_name = name if _is_expert(name) else f"{name}.weight"
        if float_name in out:
            continue
        keys = {suffix: _stored_key(name, suffix) for suffix in scheme.stored}
        stored = {suffix: weights.get(k) for suffix, k in keys.items()}
        if missing := [k for suffix, k in keys.items() if stored[suffix] is None]:
            raise ValueError(f"{scheme.name}: {', '.join(missing)} missing (each quantized layer holds "
                             f"{', '.join(scheme.stored)})")
        out[float_name] = (experts.dequantize_stack if _is_expert(name) else _dequantize_one)(scheme, stored)
    return out


def _stored_key(name: str, suffix: str) -> str:
    return experts.stored_name(name, suffix) if _is_expert(name) else f"{name}.{suffix}"


def _dequantize_one(scheme: Scheme, stored: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return scheme.dequantize(stored)


def weight_bytes(model: Any) -> int:
    """The bytes of the model's parameters and buffers as held (stored forms included)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())
