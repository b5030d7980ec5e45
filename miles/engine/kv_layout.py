"""How the running batch lays out its K/V cache: rows left-padded to one width, and the held prefixes of
admitted prompts (:mod:`miles.engine.prefix_cache`) placed before their uncached suffixes."""

from __future__ import annotations

from transformers import DynamicCache
from miles.lazy import lazy_module

torch = lazy_module("torch")

__all__ = ["past_block", "pack", "left_pad"]


def past_block(hits: list[tuple[int, torch.Tensor | None]], past: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each row's held K/V (``[layers, 2, heads, h, dim]``) right-aligned in ``past`` columns: DynamicCache data."""
    some = next(kv for _, kv in hits if kv is not None)
    layers, _, heads, _, dim = some.shape
    block = some.new_zeros(layers, 2, len(hits), heads, past, dim)
    for row, (h, kv) in enumerate(hits):
        if h:
            block[:, :, row, :, past - h :] = kv
    return [(block[i, 0], block[i, 1]) for i in range(layers)]


def pack(cache: DynamicCache, mask: torch.Tensor, rows: list[int], span: int) -> torch.Tensor:
    """Make the prefill's cache hold ``rows`` (repeats allowed), each with its attended columns moved to the right
    end of ``span`` columns, in order (no holes); returns their mask."""
    index = torch.tensor(rows, device=mask.device)
    order = mask.argsort(dim=1, stable=True)[index][:, -span:]  # unattended columns first, each kind in order
    for layer in cache.layers:
        gather = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
        layer.keys, layer.values = layer.keys[index].gather(2, gather), layer.values[index].gather(2, gather)
    return mask[index].gather(1, order)


def left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """Pad dim 1 (mask) or dim 2 (cache ``[B, H, T, D]``) on the left with zeros up to ``width``."""
    dim = 1 if t.dim() == 2 else 2
    missing = width - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)
