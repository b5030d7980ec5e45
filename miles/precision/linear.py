"""A model's linear layers in a precision scheme: which layers, the engine's quantized layer, and the conversions of a
weight dict between its float form (what the trainer holds) and its stored form (what the engine holds).

By default a scheme applies to every ``nn.Linear`` of the decoder's layers (``layers.<i>.``): attention and MLP
projections. Embeddings, norms, the MoE router, the output layer and a vision tower stay in high precision, as the
published FP8 and INT4 checkpoints keep them; ``include``/``exclude`` (substrings of module names) change that.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from miles.lazy import lazy_module
from miles.precision.schemes import Scheme

torch = lazy_module("torch")

__all__ = ["QuantizedLinear", "target_modules", "shape_problems", "quantize_model", "quantize_weights",
           "dequantize_weights", "stored_names", "weight_bytes", "float_bytes"]

_DECODER_LAYER = re.compile(r"(^|\.)layers\.\d+\.")
_NEVER = ("visual", "vision_tower", "lm_head", "embed")


def target_modules(model: Any, include: Sequence[str] = (), exclude: Sequence[str] = ()) -> list[str]:
    """The qualified names of the linear layers a scheme applies to, in the model's order: by default every
    ``nn.Linear`` inside a decoder layer; with ``include``, those whose name contains one of its strings; never one
    whose name contains a string of ``exclude``."""
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) and not isinstance(module, QuantizedLinear):
            continue
        chosen = any(s in name for s in include) if include else (
            bool(_DECODER_LAYER.search(name)) and not any(s in name for s in _NEVER))
        if chosen and not any(s in name for s in exclude):
            names.append(name)
    return names


def shape_problems(model: Any, scheme: Scheme, names: Iterable[str]) -> list[str]:
    """``<module> [out, in]: why`` for each named layer whose weight the scheme cannot take."""
    modules = dict(model.named_modules())
    problems = []
    for name in names:
        shape = tuple(_weight_shape(modules[name]))
        if (why := scheme.check(shape)) is not None:
            problems.append(f"{name} {list(shape)}: {why}")
    return problems


def _weight_shape(module: Any) -> tuple[int, int]:
    return (module.out_features, module.in_features)


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
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, child)
        if isinstance(linear, torch.nn.Linear):
            setattr(parent, child, QuantizedLinear.from_linear(linear, scheme))


def stored_names(scheme: Scheme, names: Iterable[str]) -> set[str]:
    """The state-dict names of the stored tensors of the named layers."""
    return {f"{name}.{suffix}" for name in names for suffix in scheme.stored}


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
        else:
            out[key] = tensor
    return out


def dequantize_weights(weights: Mapping[str, torch.Tensor], scheme: Scheme,
                       names: Sequence[str]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`quantize_weights`: each named layer's stored tensors replaced by ``<name>.weight`` in
    float32. A layer with a stored tensor missing is a ValueError naming the tensor."""
    out: dict[str, torch.Tensor] = {}
    done: set[str] = set()
    by_module: dict[str, dict[str, torch.Tensor]] = {}
    targets = set(names)
    for key, tensor in weights.items():
        module, _, leaf = key.rpartition(".")
        if module in targets and leaf in scheme.stored:
            by_module.setdefault(module, {})[leaf] = tensor
    for key, tensor in weights.items():
        module, _, leaf = key.rpartition(".")
        if module in targets and leaf in scheme.stored:
            if module not in done:
                stored = by_module[module]
                missing = [f"{module}.{s}" for s in scheme.stored if s not in stored]
                if missing:
                    raise ValueError(f"{scheme.name}: {', '.join(missing)} missing (each quantized layer holds "
                                     f"{', '.join(scheme.stored)})")
                out[f"{module}.weight"] = scheme.dequantize(stored)
                done.add(module)
        else:
            out[key] = tensor
    return out


def weight_bytes(model: Any) -> int:
    """The bytes of the model's parameters and buffers as held (stored forms included)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def float_bytes(model: Any, dtype: Any = None) -> int:
    """The bytes the model's weights would take with every quantized layer in ``dtype`` (default: bfloat16)."""
    dtype = dtype or torch.bfloat16
    total = 0
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            total += module.in_features * module.out_features * torch.tensor([], dtype=dtype).element_size()
            if module.bias is not None:
                total += module.bias.numel() * module.bias.element_size()
    plain = {id(t): t for m in model.modules() if not isinstance(m, QuantizedLinear)
             for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]}
    return total + sum(t.numel() * torch.tensor([], dtype=dtype).element_size() if t.is_floating_point()
                       else t.numel() * t.element_size() for t in plain.values())
