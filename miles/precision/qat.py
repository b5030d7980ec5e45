"""Quantization-aware training (``backend.qat``): the training forward computes each quantized layer as the engine
that serves the scheme does, with straight-through gradients, so that the trained model is the one the engine serves.

Each target ``nn.Linear`` keeps its float master weight (the optimizer's, and what the state dict and checkpoints
hold); its forward uses ``w + (fake(w) - w).detach()`` for the weight, ``fake`` being the scheme's quantize-then-
dequantize, and likewise for its input (``scheme.activation``; the identity for weight-only schemes such as
``int4_w4a16``). The gradient passes through both as if they were not quantized (the straight-through estimator, as
torchao's QAT fake quantizers do), and the forward's values are the engine's.
"""

from __future__ import annotations

import types
from typing import Any

from miles.lazy import lazy_module
from miles.precision.experts import EXPERT_PARAMS, dequantize_stack, experts_forward, is_experts, quantize_stack
from miles.precision.linear import shape_problems, target_modules
from miles.precision.schemes import Scheme, from_spec

torch = lazy_module("torch")

__all__ = ["apply_qat", "straight_through"]


def straight_through(value: torch.Tensor, quantized: torch.Tensor) -> torch.Tensor:
    """``quantized``'s values with ``value``'s gradient."""
    return value + (quantized - value).detach()


def _forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    scheme: Scheme = self.qat_scheme
    with torch.no_grad():
        fake_weight = scheme.fake_quantize(self.weight).to(self.weight.dtype)
        fake_input = scheme.activation(x.detach())
    weight = straight_through(self.weight, fake_weight)
    x = x if scheme.weight_only else straight_through(x, fake_input)
    return torch.nn.functional.linear(x, weight, self.bias)


def _experts_forward(self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    scheme: Scheme = self.qat_scheme
    weights = {}
    for param in EXPERT_PARAMS:
        value = getattr(self, param)
        with torch.no_grad():
            fake = dequantize_stack(scheme, quantize_stack(scheme, value.detach())).to(value.dtype)
        weights[param] = straight_through(value, fake)

    def linear(x: torch.Tensor, param: str, expert: int) -> torch.Tensor:
        if not scheme.weight_only:
            with torch.no_grad():
                fake_input = scheme.activation(x.detach())
            x = straight_through(x, fake_input)
        return torch.nn.functional.linear(x, weights[param][expert])

    return experts_forward(self, hidden_states, top_k_index, top_k_weights, linear)


def apply_qat(model: Any, scheme: Scheme | dict[str, Any]) -> list[str]:
    """Make the target layers of ``scheme`` (or of its spec) in ``model`` compute as its engine does (state dict
    unchanged); returns their names. A layer whose shape the scheme cannot take is a ValueError naming it."""
    scheme = from_spec(scheme) if isinstance(scheme, dict) else scheme
    names = target_modules(model, scheme.include, scheme.exclude)
    if problems := shape_problems(model, scheme, names):
        raise ValueError(f"backend.qat: {scheme.name} cannot take {len(problems)} layer(s): {'; '.join(problems)}")
    for name in names:
        owner, _, param = name.rpartition(".")
        if param in EXPERT_PARAMS and is_experts(module := model.get_submodule(owner)):
            module.qat_scheme = scheme
            module.forward = types.MethodType(_experts_forward, module)
            continue
        module = model.get_submodule(name)
        module.qat_scheme = scheme
        module.forward = types.MethodType(_forward, module)
    return names
