"""AdamW over a model-parallel Megatron model: gradients summed over data-parallel ranks, the
gradient norm taken over the whole model (each tensor-parallel and expert-parallel shard counted
once), clipping, then the update.

Miles' training core (:class:`miles.train.api.Policy`) calls ``optimizer.step()`` after the
micro-batches' backward passes; this class does the parallel part inside that call.
megatron-core's own optimizers allocate on ``'cuda'`` (``megatron/core/optimizer/optimizer.py``,
``clip_grads.py``), so they cannot run on CPU.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ParallelAdamW", "is_expert", "is_tensor_parallel"]


def is_expert(param: torch.nn.Parameter) -> bool:
    """Megatron marks expert-parallel weights with ``allreduce=False``."""
    return not getattr(param, "allreduce", True)


def is_tensor_parallel(param: torch.nn.Parameter) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def _size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce(tensors: list[torch.Tensor], group: Any) -> None:
    """Sum ``tensors`` in place over ``group`` (one flat collective)."""
    if not tensors or _size(group) == 1:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset: offset + t.numel()].view_as(t))
        offset += t.numel()


class ParallelAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose ``step`` first reduces and clips the gradients (see the module docstring).

    ``groups``: the process groups (``dp`` for dense weights, ``expert_dp`` for expert weights,
    ``tp`` and ``ep`` for the norm), None where the size is 1. ``tp_summed``: weights held whole on
    each tensor-parallel rank whose gradients are partial there (summed over ``tp`` first).
    ``norms`` records each step's gradient norm before clipping.
    """

    def __init__(self, params: list[torch.nn.Parameter], *, max_grad_norm: float, groups: dict[str, Any],
                 tp_summed: list[torch.nn.Parameter] = (), **adamw: Any) -> None:
        params = list(params)
        super().__init__(params, **adamw)
        self.max_grad_norm, self.groups = max_grad_norm, groups
        self._tp_summed = {id(p) for p in tp_summed}
        self.norms: list[float] = []

    def _grads(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:  # e.g. an expert that got no token: its gradient is zero
                    p.grad = torch.zeros_like(p)
                out.append((p, p.grad))
        return out

    @torch.no_grad()
    def reduce_and_clip(self) -> float:
        grads = self._grads()
        _all_reduce([g for p, g in grads if id(p) in self._tp_summed], self.groups.get("tp"))
        _all_reduce([g for p, g in grads if not is_expert(p)], self.groups.get("dp"))
        _all_reduce([g for p, g in grads if is_expert(p)], self.groups.get("expert_dp"))
        squares = {kind: torch.zeros((), dtype=torch.float64) for kind in ("tp", "ep", "whole")}
        for p, g in grads:
            kind = "ep" if is_expert(p) else "tp" if is_tensor_parallel(p) else "whole"
            squares[kind] += g.double().pow(2).sum()
        for kind in ("tp", "ep"):
            if _size(self.groups.get(kind)) > 1:
                dist.all_reduce(squares[kind], group=self.groups[kind])
        norm = math.sqrt(float(sum(squares.values())))
        if self.max_grad_norm > 0:
            coef = min(1.0, self.max_grad_norm / (norm + 1e-6))
            if coef < 1.0:
                for _, g in grads:
                    g.mul_(coef)
        return norm

    def step(self, closure: Any = None) -> Any:
        self.norms.append(self.reduce_and_clip())
        return super().step(closure)
