"""The Triton programs: one program per row of a chunk's logits.

Forward: an online softmax over blocks of ``BLOCK`` vocabulary columns keeps the running maximum ``m``,
``s = sum exp(x - m)`` and ``t = sum exp(x - m) * (x - m)``, rescaling both when ``m`` grows; then
``lse = m + log s``, the entropy is ``log s - t / s`` and the log-prob is ``x[target] - lse``.
Backward: ``grad = grad_lp * (onehot - p) - grad_ent * p * (log p + entropy)``, block by block, written
where the caller says (the logits' own storage in Miles' chunked path: each program reads a block before
writing it).

Imported only when a kernel runs: ``triton.jit`` picks compiled or interpreted (``TRITON_INTERPRET=1``)
programs at import, which :data:`INTERPRETED` records.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


@triton.jit
def _forward_kernel(logits_ptr, targets_ptr, logprobs_ptr, entropy_ptr, lse_ptr, vocab, row_stride,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    m = -1.0e30  # finite: the first rescaling multiplies s = 0 by (m - m_new)
    s = 0.0
    t = 0.0
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        scale = tl.exp(m - m_new)
        e = tl.exp(x - m_new)
        t = scale * (t + (m - m_new) * s) + tl.sum(e * tl.where(e > 0.0, x - m_new, 0.0), axis=0)
        s = scale * s + tl.sum(e, axis=0)
        m = m_new
    log_s = tl.log(s)
    lse = m + log_s
    target = tl.load(targets_ptr + row)
    tl.store(logprobs_ptr + row, tl.load(row_ptr + target).to(tl.float32) - lse)
    tl.store(entropy_ptr + row, log_s - t / s)
    tl.store(lse_ptr + row, lse)


@triton.jit
def _backward_kernel(logits_ptr, grad_ptr, targets_ptr, lse_ptr, entropy_ptr, grad_logprobs_ptr, grad_entropy_ptr,
                     vocab, row_stride, grad_row_stride, HAS_GRAD_ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lse = tl.load(lse_ptr + row)
    grad_lp = tl.load(grad_logprobs_ptr + row)
    target = tl.load(targets_ptr + row)
    grad_ent = tl.load(grad_entropy_ptr + row)  # a stand-in (unused) without HAS_GRAD_ENTROPY
    entropy = tl.load(entropy_ptr + row)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < vocab
        log_p = tl.load(logits_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32) - lse
        p = tl.exp(log_p)
        grad = tl.where(cols == target, grad_lp, 0.0) - p * grad_lp
        if HAS_GRAD_ENTROPY:
            grad = grad - p * grad_ent * (log_p + entropy)
        tl.store(grad_ptr + row * grad_row_stride + cols, grad, mask=mask)


def _block(vocab: int, block: int) -> int:
    return max(16, min(block, triton.next_power_of_2(vocab)))


def forward(logits: torch.Tensor, targets: torch.Tensor, block: int,
            num_warps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, vocab = logits.shape
    out = torch.empty((3, n), dtype=torch.float32, device=logits.device)
    if n:
        _forward_kernel[(n,)](logits, targets, out[0], out[1], out[2], vocab, logits.stride(0),
                              BLOCK=_block(vocab, block), num_warps=num_warps)
    return out[0], out[1], out[2]


def backward(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
             grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor | None, block: int,
             num_warps: int) -> torch.Tensor:
    """The logits' gradient, written into the logits' storage."""
    n, vocab = logits.shape
    if n:
        has_entropy = grad_entropy is not None
        _backward_kernel[(n,)](logits, logits, targets, lse, entropy, grad_logprobs,
                               grad_entropy if has_entropy else grad_logprobs, vocab, logits.stride(0),
                               logits.stride(0), HAS_GRAD_ENTROPY=has_entropy, BLOCK=_block(vocab, block),
                               num_warps=num_warps)
    return logits
