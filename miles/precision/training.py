"""Training in low precision (``backend.precision``): every matmul of the target linear layers, forward and backward,
takes its two operands quantized along the dimension it sums over, as the recipe's kernels do (MXFP8 and NVFP4 as in
torchao's MX training, block FP8 as DeepSeek-V3 trains); the product is computed in float32 from the dequantized
operands, so the values are the kernels' and the master weights and optimizer state stay float32.

For ``y = x W^T`` (``x [M, K]``, ``W [N, K]``):

- forward: ``x`` quantized per token along ``K`` (``scheme.activation``), ``W`` as the scheme stores it (along ``K``;
  128x128 blocks for ``fp8_block``) -- the rollout engine's own numerics under the same scheme ("unified FP8");
- input gradient ``dx = dy W``: ``dy`` along ``N``, ``W`` along ``N``;
- weight gradient ``dW = dy^T x``: ``dy`` and ``x`` along the tokens ``M`` (zero-padded to a whole group).

The numerics are emulated exactly on every device, a GPU included: selecting real kernels behind this option
(torchao's MX linear, TransformerEngine) is not done yet, as no GPU has been at hand to check them against this.
"""

from __future__ import annotations

import types
from typing import Any

from miles.lazy import lazy_module
from miles.precision.experts import EXPERT_PARAMS, experts_forward, is_experts
from miles.precision.linear import shape_problems, target_modules
from miles.precision.schemes import Scheme, from_spec

torch = lazy_module("torch")

__all__ = ["apply_training_precision", "quantize_along_rows", "quantized_training"]


def quantize_along_rows(scheme: Scheme, t: torch.Tensor) -> torch.Tensor:
    """``t [R, C]`` quantized and dequantized in groups along each row, as the scheme quantizes an input (its rows
    zero-padded to a whole group, which changes no group's scale)."""
    group = getattr(scheme, "group_size", 0)
    pad = -t.shape[1] % group if group else 0
    padded = torch.nn.functional.pad(t, (0, pad)) if pad else t
    return scheme.activation(padded.contiguous())[:, : t.shape[1]]


class _LowPrecisionMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, scheme: Scheme) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.scheme = scheme
        return quantize_along_rows(scheme, x) @ scheme.fake_quantize(weight).t()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight = ctx.saved_tensors
        scheme = ctx.scheme
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # dy [M, N] @ W [N, K]: summed over N
            grad_x = quantize_along_rows(scheme, grad) @ quantize_along_rows(scheme, weight.t().float()).t()
        if ctx.needs_input_grad[1]:  # dy^T [N, M] @ x [M, K]: summed over the tokens M
            grad_w = quantize_along_rows(scheme, grad.t()) @ quantize_along_rows(scheme, x.t()).t()
        return grad_x, grad_w, None


def _forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).float()
    y = _LowPrecisionMatmul.apply(rows, self.weight.float(), self.training_scheme)
    if self.bias is not None:
        y = y + self.bias.float()
    return y.reshape(*x.shape[:-1], -1).to(x.dtype)


def _experts_forward(self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    def linear(x: torch.Tensor, param: str, expert: int) -> torch.Tensor:
        weight = getattr(self, param)[expert]
        return _LowPrecisionMatmul.apply(x.float(), weight.float(), self.training_scheme).to(x.dtype)

    return experts_forward(self, hidden_states, top_k_index, top_k_weights, linear)


def _shape(modules: dict[str, Any], name: str) -> tuple[int, int]:
    """``[out, in]`` of a linear layer, or of each expert's matrix."""
    owner, _, param = name.rpartition(".")
    if param in EXPERT_PARAMS and owner in modules and is_experts(modules[owner]):
        out, inp = getattr(modules[owner], param).shape[1:]
        return int(out), int(inp)
    return modules[name].out_features, modules[name].in_features


def apply_training_precision(model: Any, scheme: Scheme | dict[str, Any]) -> list[str]:
    """Make the target layers of ``scheme`` (or of its spec) in ``model`` train in it (state dict unchanged); returns
    their names. A weight-only scheme (nothing to quantize in the backward) or a layer whose shape the scheme
    cannot take is a ValueError naming it."""
    scheme = from_spec(scheme) if isinstance(scheme, dict) else scheme
    if scheme.weight_only:
        raise ValueError(f"backend.precision: {scheme.name} quantizes weights only; training in low precision "
                         f"quantizes every operand: use mxfp8, nvfp4, fp8_block or fp8_channel (or backend.qat: "
                         f"{scheme.name} to train on what its engine serves)")
    names = target_modules(model, scheme.include, scheme.exclude)
    modules = dict(model.named_modules())
    problems = shape_problems(model, scheme, names)
    group = getattr(scheme, "group_size", 0)
    problems += [f"{n} {list(_shape(modules, n))}: its {_shape(modules, n)[0]} output channels are not a multiple of "
                 f"the group of {group} its input gradient sums over"
                 for n in names if group and _shape(modules, n)[0] % group]
    if problems:
        raise ValueError(f"backend.precision: {scheme.name} cannot take {len(problems)} layer(s): "
                         f"{'; '.join(problems)}")
    for name in names:
        owner, _, param = name.rpartition(".")
        if param in EXPERT_PARAMS and owner in modules and is_experts(modules[owner]):
            modules[owner].training_scheme = scheme
            modules[owner].forward = types.MethodType(_experts_forward, modules[owner])
            continue
        module = modules[name]
        module.training_scheme = scheme
        module.forward = types.MethodType(_forward, module)
    return names


def quantized_training(model: Any, *, qat: dict[str, Any] | None, precision: dict[str, Any] | None) -> None:
    """A backend's options applied to its model: ``backend.qat`` (the engine's numerics in the forward, straight-
    through gradients: :mod:`miles.precision.qat`) or ``backend.precision`` (every operand quantized, forward and
    backward); neither changes the state dict."""
    from miles.precision.qat import apply_qat

    if qat is not None:
        apply_qat(model, qat)
    if precision is not None:
        apply_training_precision(model, precision)
