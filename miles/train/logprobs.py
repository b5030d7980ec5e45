"""Per-token log-probs of a causal LM over right-padded sequences, whole or memory-bounded.

The whole path takes the model's ``[B, L, V]`` logits in float32 and builds log-probs and entropy from
them: several ``[tokens x vocab]`` float32 tensors live at once, forward and backward. The chunked path
(``chunk_tokens > 0``) never makes them: it hands the output layer's input (the final hidden states) to
:class:`ChunkedLogprobs`, which computes ``chunk_tokens`` rows of logits at a time with a log-prob
kernel (:mod:`miles.train.kernels`) and recomputes them in the backward pass.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from miles.models.sampling import distribution_logits, scaled_logits
from miles.train.kernels import LogprobKernel, TorchKernel, select_kernel
from miles.types import TokenSampling

__all__ = ["token_logprobs", "ChunkedLogprobs", "matmul_dtype", "output_layer", "patched_head"]

# Config fields of HF models whose forward changes the output layer's result (soft-capping, scaling):
# the chunked path computes log-probs from the output layer alone, so it refuses them.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, with_entropy: bool = False,
                   entropy_grad: bool = False, *, chunk_tokens: int = 0, kernel: LogprobKernel | str | None = None,
                   inputs: dict[str, torch.Tensor] | None = None, never_generated: list[int] | None = None,
                   sampling: TokenSampling | None = None):
    """``[B, L-1]``: column ``t`` is log p(input_ids[:, t+1] | input_ids[:, :t+1]).

    Sequences are right-padded, so causal attention alone keeps padding out of every real token's
    context; padded columns hold garbage that the loss mask removes. With ``with_entropy``, also the
    entropy of each predicted distribution (``[B, L-1]``; differentiable only with ``entropy_grad``,
    which an entropy bonus needs).

    ``chunk_tokens > 0`` computes the same figures over chunks of that many tokens without the
    ``[tokens x vocab]`` float32 logits, forward and backward, with ``kernel`` (a kernel, a registered
    name resolved by :func:`miles.train.kernels.select_kernel` for the input's device, or None: the
    ``torch`` kernel). The model's output layer must be an ``nn.Linear`` whose result the model returns
    unchanged as its logits (HF causal LMs without logit soft-capping or scaling). ``inputs``: more arguments of
    the model's forward (a vision-language model's positions and pixels, :func:`miles.models.vision.row_inputs`).
    ``never_generated``: token ids left out of every distribution (a vision-language model's image tokens, as the
    engine samples without them); a column whose target is one of them (a prompt's image) holds 0, never -inf.
    ``sampling``: the distribution of each column (its temperature, and top-p/top-k for the truncated one:
    :mod:`miles.models.sampling`); None: the model's own.
    """
    inputs = inputs or {}
    if chunk_tokens > 0:
        if never_generated:
            raise ValueError("logprob_chunk_tokens: the chunked path cannot leave out a vision-language model's "
                             "image tokens; set backend.logprob_chunk_tokens to 0 for such a model")
        if sampling is not None and sampling.top_p is not None:
            raise ValueError("logprob_chunk_tokens: the chunked path cannot truncate the vocabulary by top-p/top-k "
                             "(rollout.logprobs_of: truncated); set backend.logprob_chunk_tokens to 0")
        temperature = None if sampling is None else sampling.temperature.to(input_ids.device)
        return _chunked(model, input_ids, with_entropy, entropy_grad, chunk_tokens, kernel, inputs, temperature)
    logits = model(input_ids=input_ids, **inputs).logits[:, :-1].float()
    if never_generated:
        logits = logits.index_fill(-1, torch.tensor(never_generated, device=logits.device), float("-inf"))
    targets = input_ids[:, 1:]
    if sampling is not None:
        logits = distribution_logits(logits, *sampling.on(logits.device), keep=targets)
    return _gathered(logits, targets, with_entropy, entropy_grad, masked=bool(never_generated))


def _gathered(logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool, entropy_grad: bool, *,
              masked: bool = False):
    """Log-probs of ``targets`` (``[...]``) under ``logits`` (``[..., V]``, float32), and the entropy of each
    distribution when asked. ``masked``: a target at ``-inf`` (a left-out token) gets 0, never ``-inf``."""
    log_norm = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_norm
    if masked:  # an image token's column is never in a loss; -inf there would make 0 * -inf = nan
        logprobs = logprobs.masked_fill(torch.isneginf(logprobs), 0.0)
    if not with_entropy:
        return logprobs
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        log_p = logits - log_norm.unsqueeze(-1)
        terms = log_p.exp() * log_p  # 0 * -inf of a left-out token: nan, taken as 0
        return logprobs, -torch.where(torch.isfinite(log_p), terms, torch.zeros_like(terms)).sum(dim=-1)


def _chunked(model: torch.nn.Module, input_ids: torch.Tensor, with_entropy: bool, entropy_grad: bool,
             chunk_tokens: int, kernel: LogprobKernel | str | None, inputs: dict[str, torch.Tensor],
             temperature: torch.Tensor | None = None):
    if kernel is None:
        kernel = TorchKernel()
    elif isinstance(kernel, str):
        kernel = select_kernel(kernel, input_ids.device)
    head = output_layer(model)
    targets = input_ids[:, 1:]

    def head_forward(hidden: torch.Tensor) -> torch.Tensor:
        # Called inside the model's forward, so that a sharded (FSDP2) root has gathered the head's weight and
        # hooks the result for its backward. Returns [B, L-1, 2]: log-probs and entropy, as the "logits".
        rows, width = targets.shape
        states = hidden[:, :-1].reshape(rows * width, hidden.shape[-1])
        logprobs, entropy = ChunkedLogprobs.apply(states, head.weight, head.bias, targets.reshape(-1), chunk_tokens,
                                                   kernel, entropy_grad, matmul_dtype(states, head.weight),
                                                   None if temperature is None else temperature.reshape(-1))
        return torch.stack([logprobs, entropy], dim=-1).view(rows, width, 2)

    with patched_head(head, head_forward):
        packed = model(input_ids=input_ids, **inputs).logits
    logprobs = packed[..., 0].contiguous()
    if not with_entropy:
        return logprobs
    entropy = packed[..., 1].contiguous()
    return logprobs, entropy if entropy_grad and torch.is_grad_enabled() else entropy.detach()


def output_layer(model: torch.nn.Module) -> torch.nn.Linear:
    """The output layer the chunked path computes with: an ``nn.Linear`` whose result the model returns unchanged."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"logprob_chunk_tokens needs a model whose output layer is an nn.Linear; "
                         f"{type(model).__name__}'s is {type(head).__name__}")
    config = getattr(model, "config", None)
    transforms = [name for name in _LOGIT_TRANSFORMS if getattr(config, name, None) not in (None, 0, 1, 1.0)]
    if transforms:
        raise ValueError(f"logprob_chunk_tokens: {type(model).__name__} transforms its logits after the output "
                         f"layer ({', '.join(transforms)}); use logprob_chunk_tokens=0 for this model")
    return head


@contextlib.contextmanager
def patched_head(head: torch.nn.Module, forward: Any) -> Iterator[None]:
    """``head.forward`` replaced by ``forward`` within the block (called inside the model's own forward)."""
    patched = head.__dict__.get("forward")
    head.forward = forward
    try:
        yield
    finally:
        if patched is None:
            del head.forward
        else:
            head.forward = patched


def matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype of the logits matmul: autocast's when it is on (as the model's own output layer would run,
    so both paths see the same logits), else the inputs'. Kernels always get the logits in float32."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _cast(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
    return weight.to(dtype), None if bias is None else bias.to(dtype)


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                  temperature: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 logits of one chunk, at each row's temperature (``[rows]``; None: 1)."""
    logits = torch.nn.functional.linear(hidden.to(dtype), weight, bias).float()
    return scaled_logits(logits, temperature).contiguous()


class ChunkedLogprobs(torch.autograd.Function):
    """``hidden [N, H]``, ``weight [V, H]``, ``bias [V] | None``, ``targets [N]`` -> log-probs and entropy ``[N]``
    (float32), ``chunk_tokens`` rows of logits at a time; ``temperature [N] | None``: each row's (the logits are
    divided by it, :func:`miles.models.sampling.scaled_logits`). Saves the inputs and the per-token log-sum-exp
    and entropy; the backward pass recomputes each chunk's logits, has the kernel turn them into the gradient of
    the logits (divided by the temperature on the way back), and multiplies that out into the hidden states' and
    weight's gradients (the weight's summed over chunks in float32)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, chunk_tokens: int, kernel: LogprobKernel, entropy_grad: bool,
                dtype: torch.dtype, temperature: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        logprobs, entropy, lse = (torch.empty(n, dtype=torch.float32, device=hidden.device) for _ in range(3))
        with torch.autocast(hidden.device.type, enabled=False):
            w, b = _cast(weight, bias, dtype)
            for start in range(0, n, chunk_tokens):
                rows = slice(start, start + chunk_tokens)
                logits = _chunk_logits(hidden[rows], w, b, dtype, None if temperature is None else temperature[rows])
                logprobs[rows], entropy[rows], lse[rows] = kernel.forward(logits, targets[rows])
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy, temperature)
        ctx.chunk_tokens, ctx.kernel, ctx.dtype = chunk_tokens, kernel, dtype
        ctx.set_materialize_grads(False)
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx: Any, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        hidden, weight, bias, targets, lse, entropy, temperature = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        n, dtype = hidden.shape[0], ctx.dtype
        if grad_logprobs is None:
            grad_logprobs = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        grad_logprobs = grad_logprobs.float()
        grad_entropy = None if grad_entropy is None else grad_entropy.float()
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_bias else None
        with torch.autocast(hidden.device.type, enabled=False):
            w, b = _cast(weight, bias, dtype)
            for start in range(0, n, ctx.chunk_tokens):
                rows = slice(start, start + ctx.chunk_tokens)
                h = hidden[rows].to(dtype)
                scale = None if temperature is None else temperature[rows]
                logits = _chunk_logits(h, w, b, dtype, scale)
                grad_logits = ctx.kernel.backward(logits, targets[rows], lse[rows], entropy[rows], grad_logprobs[rows],
                                                  None if grad_entropy is None else grad_entropy[rows])
                if scale is not None:  # the logits the kernel saw were divided by the temperature
                    grad_logits = scaled_logits(grad_logits, scale)
                if need_bias:
                    grad_bias += grad_logits.sum(dim=0)
                grad_logits = grad_logits.to(dtype)
                if need_hidden:
                    grad_hidden[rows] = grad_logits @ w
                if need_weight and dtype == torch.float32:
                    grad_weight.addmm_(grad_logits.t(), h)
                elif need_weight:
                    grad_weight += (grad_logits.t() @ h).float()
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None
