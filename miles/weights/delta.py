"""Delta weight pushes: only the blocks of the weights that changed since the version the engines hold.

``rollout.weight_sync: {name: shm, delta: true}`` (or ``tensor``, ``auto``; the transports:
:mod:`miles.weights.delta_transports`; this module is the format and the checksums, which both planes share).
Each tensor's bytes are cut into blocks of ``block_kib`` (a smaller tensor is one block). A push compares the
new weights with the last pushed ones block by block and sends a delta section: the version it applies to
(``base_version``), the checksum of the whole weight set at that version (``base_checksum``) and after it
(``checksum``), ``block_bytes``, and the changed blocks (``blocks``: per tensor, runs ``[first, end)`` of block
indices); ``shm`` adds it to its descriptor as ``delta`` (its file holds the whole new version), ``tensor``
posts safetensors bytes of the changed runs (:func:`encode_blocks`) with the section as their metadata
``miles_delta``. The engine copies only those blocks, after checking that its weights are the base (version and
checksum) and that the blocks give the announced result; otherwise it applies nothing and answers 409 with
``full_push_needed``, and the trainer sends that engine the whole weights. An engine the trainer knows to hold
another version (it missed a push, restarted, or was quarantined) gets the whole weights straight away, and so
does every catch-up. So an engine holds the trainer's weights bit for bit, or its old version; never a mix.

The checksum of a block is the sum, in int64, of its 32-bit words each multiplied (mod 2**32) by a fixed odd
coefficient of its position: torch ops, so an engine computes it where its weights live (GPU or CPU), exact
whatever the reduction's order, and a change of any one word changes it. A weight set's checksum mixes its
blocks' with their index and their tensor's name (:func:`set_checksum`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from miles.lazy import lazy_module

torch = lazy_module("torch")

__all__ = ["MAX_BLOCK_BYTES", "DeltaRefused", "Delta", "block_checksums", "set_checksum", "weights_checksum",
           "parse_delta", "delta_blocks", "check_delta", "changed_blocks", "runs", "raw_bytes", "delta_section",
           "payload_blocks", "encode_blocks"]

MASK = (1 << 64) - 1
MAX_BLOCK_BYTES = 64 << 20  # a block's checksum needs a coefficient per 4 bytes of it: 64 MiB of them at most
ROWS_PER_PASS = 64  # blocks summed at once: bounds the temporary memory to 64 blocks' words


# -- checksums (both planes) -----------------------------------------------------------------------------


_COEFFICIENTS: dict[tuple[int, str], torch.Tensor] = {}


def _coefficients(words: int, device: torch.device) -> torch.Tensor:
    """``words`` odd int32 coefficients, the same on every machine and device (a seeded CPU generator)."""
    key = (words, str(device))
    if key not in _COEFFICIENTS:
        generator = torch.Generator().manual_seed(0x4D494C45)
        coefficients = torch.randint(-2**31, 2**31 - 1, (words,), generator=generator, dtype=torch.int32) | 1
        _COEFFICIENTS[key] = coefficients.to(device)
    return _COEFFICIENTS[key]


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor, flat (``uint8``, no copy); a ValueError if it is not contiguous."""
    if not tensor.is_contiguous():
        raise ValueError("not contiguous")
    flat = tensor.detach().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def _words(raw: torch.Tensor) -> torch.Tensor:
    """``raw`` (bytes, a multiple of 4) as int32 words (a copy only if its address is not 4-aligned)."""
    try:
        return raw.view(torch.int32)
    except RuntimeError:
        return raw.clone().view(torch.int32)


def block_count(nbytes: int, block_bytes: int) -> int:
    return max(1, -(-nbytes // block_bytes))


def block_checksums(tensor: torch.Tensor, block_bytes: int) -> torch.Tensor:
    """The int64 checksum of each block of ``tensor``'s bytes, on its device (``block_bytes``: a multiple of 64)."""
    raw = raw_bytes(tensor)
    nbytes, words = raw.numel(), block_bytes // 4
    coefficients = _coefficients(words + 4, raw.device)
    full = nbytes // block_bytes
    sums = torch.zeros(block_count(nbytes, block_bytes), dtype=torch.int64, device=raw.device)
    rows = _words(raw[: full * block_bytes]).view(full, words)
    for first in range(0, full, ROWS_PER_PASS):  # int32 products wrap (mod 2**32); their sum is exact in int64
        last = min(first + ROWS_PER_PASS, full)
        sums[first:last] = (rows[first:last] * coefficients[:words]).sum(1)
    if (tail := nbytes - full * block_bytes) > 0:
        aligned = tail // 4 * 4
        rest = raw[full * block_bytes:]
        total = (_words(rest[:aligned]) * coefficients[: aligned // 4]).sum()
        odd = rest[aligned:].to(torch.int32)  # the last 1 to 3 bytes, one word each
        sums[full] = total + (odd * coefficients[aligned // 4: aligned // 4 + odd.numel()]).sum()
    return sums


def _name_factor(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") | 1


def _tensor_sum(sums: torch.Tensor) -> int:
    """One tensor's blocks mixed with their index (a swap of two blocks changes it), as an int mod 2**64."""
    index = (torch.arange(sums.numel(), dtype=torch.int64, device=sums.device) * 2 + 1) * 0x2545F4914F6CDD1D
    return int((sums * index).sum()) & MASK  # int64 products and sums wrap: exact mod 2**64


def set_checksum(sums: dict[str, torch.Tensor]) -> str:
    """The checksum of a weight set from its tensors' block checksums (any order of names), 16 hex digits."""
    total = 0
    for name, blocks in sums.items():
        total = (total + _tensor_sum(blocks) * _name_factor(name)) & MASK
    return f"{total:016x}"


def weights_checksum(weights: dict[str, torch.Tensor], block_bytes: int) -> str:
    """The checksum of ``weights`` (what ``GET /weights_checksum`` answers for the engine's)."""
    return set_checksum({name: block_checksums(t, block_bytes) for name, t in weights.items()})


# -- the engine's side ----------------------------------------------------------------------------------


class DeltaRefused(ValueError):
    """The engine's weights are not the delta's base, or the blocks do not give the announced weights: nothing
    is applied and the engine answers 409 with ``full_push_needed``."""


@dataclass(frozen=True)
class Delta:
    base_version: int
    base_checksum: str
    checksum: str
    block_bytes: int
    blocks: dict[str, list[tuple[int, int]]]  # name: runs [first, end) of block indices


def _is_int(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _is_checksum(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 16 and all(c in "0123456789abcdef" for c in value)


def parse_delta(body: Any, names: list[str]) -> Delta:
    """The ``delta`` section of a ``/update_weights_from_shm`` body; a ValueError names the field."""
    if not isinstance(body, dict):
        raise ValueError(f"delta: expected an object (base_version, base_checksum, checksum, block_bytes, blocks), "
                         f"got {type(body).__name__}")
    missing = [k for k in ("base_version", "base_checksum", "checksum", "block_bytes", "blocks") if k not in body]
    if missing:
        raise ValueError(f"delta: missing field(s): {', '.join(missing)}")
    if not _is_int(body["base_version"]):
        raise ValueError(f"delta.base_version: expected an integer >= 0, got {body['base_version']!r}")
    for key in ("base_checksum", "checksum"):
        if not _is_checksum(body[key]):
            raise ValueError(f"delta.{key}: expected 16 lowercase hex digits, got {body[key]!r}")
    block_bytes = body["block_bytes"]
    if not _is_int(block_bytes, 64) or block_bytes % 64 or block_bytes > MAX_BLOCK_BYTES:
        raise ValueError(f"delta.block_bytes: expected a multiple of 64 from 64 to {MAX_BLOCK_BYTES}, "
                         f"got {block_bytes!r}")
    blocks = body["blocks"]
    if not isinstance(blocks, dict) or not all(isinstance(v, list) for v in blocks.values()):
        raise ValueError("delta.blocks: expected an object of tensor name: list of [first, end) block runs")
    if unknown := [n for n in blocks if n not in names]:
        raise ValueError(f"delta.blocks: {unknown[0]!r} is not among the descriptor's names")
    runs: dict[str, list[tuple[int, int]]] = {}
    for name, pairs in blocks.items():
        bad = [p for p in pairs if not (isinstance(p, list) and len(p) == 2 and _is_int(p[0]) and _is_int(p[1])
                                        and p[0] < p[1])]
        if bad:
            raise ValueError(f"delta.blocks.{name}: expected runs [first, end) with 0 <= first < end, got {bad[0]!r}")
        runs[name] = [(p[0], p[1]) for p in pairs]
    return Delta(body["base_version"], body["base_checksum"], body["checksum"], block_bytes, runs)


def delta_blocks(tensors: dict[str, torch.Tensor], delta: Delta) -> list[tuple[str, int, torch.Tensor]]:
    """(name, first byte, bytes) of every changed block, as views of ``tensors`` (the file's)."""
    blocks = []
    for name, runs in delta.blocks.items():
        raw = raw_bytes(tensors[name])
        count = block_count(raw.numel(), delta.block_bytes)
        for first, end in runs:
            if end > count:
                raise ValueError(f"delta.blocks.{name}: run [{first}, {end}) goes past its {count} block(s)")
            start = first * delta.block_bytes
            blocks.append((name, start, raw[start: end * delta.block_bytes]))
    return blocks


def delta_section(raw: bytes) -> Any:
    """The ``miles_delta`` metadata of safetensors bytes (the delta of a ``tensor`` push, JSON), else None."""
    try:
        size = int.from_bytes(raw[:8], "little")
        metadata = json.loads(raw[8:8 + size]).get("__metadata__") or {}
        return json.loads(metadata["miles_delta"]) if "miles_delta" in metadata else None
    except (ValueError, AttributeError, TypeError) as exc:
        raise ValueError(f"body: the safetensors metadata miles_delta is not JSON ({exc})") from exc


def payload_blocks(payload: dict[str, torch.Tensor], delta: Delta, sizes: dict[str, int]
                   ) -> list[tuple[str, int, torch.Tensor]]:
    """(name, first byte, bytes) of every run of a ``tensor`` delta: the payload's tensor ``"<k>"`` (uint8) is the
    k-th run of ``delta.blocks``, in order; ``sizes``: the engine's tensors' sizes in bytes."""
    blocks, k = [], 0
    for name, runs_ in delta.blocks.items():
        for first, end in runs_:
            values = payload.get(str(k))
            expected = min(end * delta.block_bytes, sizes[name]) - first * delta.block_bytes
            if values is None or values.dtype != torch.uint8 or values.dim() != 1 or values.numel() != expected:
                got = "nothing" if values is None else f"{values.dtype} {tuple(values.shape)}"
                raise ValueError(f"delta.blocks.{name}: run [{first}, {end}) needs tensor {str(k)!r} of {expected} "
                                 f"bytes (uint8) in the body, got {got}")
            blocks.append((name, first * delta.block_bytes, values))
            k += 1
    if len(payload) != k:
        raise ValueError(f"body: {len(payload)} tensors for the {k} runs of delta.blocks")
    return blocks


def encode_blocks(weights: dict[str, torch.Tensor], section: dict[str, Any]) -> bytes:
    """Safetensors bytes of the runs ``section["blocks"]`` names (``"<k>"``: the k-th run's bytes), with the
    section as the metadata ``miles_delta``: the body of a ``tensor`` delta push."""
    from safetensors.torch import save

    block_bytes, payload = section["block_bytes"], {}
    for name, runs_ in section["blocks"].items():
        raw = raw_bytes(weights[name]).cpu()
        for first, end in runs_:
            payload[str(len(payload))] = raw[first * block_bytes: end * block_bytes].clone()
    return save(payload, metadata={"miles_delta": json.dumps(section)})


def check_delta(params: dict[str, torch.Tensor], version: int, blocks: list[tuple[str, int, torch.Tensor]],
                delta: Delta) -> None:
    """Raise :class:`DeltaRefused` unless the engine's ``params`` at ``version`` are the delta's base and the
    ``blocks`` turn them into the announced weights (the engine calls it under its step lock)."""
    if version != delta.base_version:
        raise DeltaRefused(f"the engine holds weight version {version}; the delta applies to {delta.base_version}")
    try:
        sums = {name: block_checksums(p, delta.block_bytes) for name, p in params.items()}
    except ValueError as exc:
        raise DeltaRefused(f"the engine's weights cannot be checked ({exc})") from exc
    if (mine := set_checksum(sums)) != delta.base_checksum:
        raise DeltaRefused(f"the engine's weights (checksum {mine}) are not version {delta.base_version}'s "
                           f"(checksum {delta.base_checksum})")
    for name, start, values in blocks:
        first = start // delta.block_bytes
        size = raw_bytes(params[name]).numel()
        for index in range(first, first + block_count(values.numel(), delta.block_bytes)):
            piece = values[(index - first) * delta.block_bytes: (index - first + 1) * delta.block_bytes]
            if piece.numel() != min(delta.block_bytes, size - index * delta.block_bytes):
                raise DeltaRefused(f"{name}: block {index} does not fit the engine's tensor")
            sums[name][index] = block_checksums(piece.to(sums[name].device), delta.block_bytes)[0]
    if (result := set_checksum(sums)) != delta.checksum:
        raise DeltaRefused(f"the changed blocks give weights of checksum {result}, not the announced {delta.checksum}")


# -- finding what changed (the trainer's side) ---------------------------------------------------------


def changed_blocks(new: torch.Tensor, old: torch.Tensor, block_bytes: int) -> list[int]:
    """The indices of the blocks whose bytes differ between ``new`` and ``old`` (same size): a bitwise
    comparison, so NaN payloads, -0.0 and +0.0 count as the bytes they are."""
    a, b = raw_bytes(new), raw_bytes(old.to(new.device))
    full, words = a.numel() // block_bytes, block_bytes // 4
    rows_a = _words(a[: full * block_bytes]).view(full, words)
    rows_b = _words(b[: full * block_bytes]).view(full, words)
    changed = [first + int(i) for first in range(0, full, ROWS_PER_PASS)
               for i in (rows_a[first:first + ROWS_PER_PASS] != rows_b[first:first + ROWS_PER_PASS]).any(1)
               .nonzero().flatten()]
    if a.numel() > full * block_bytes and not torch.equal(a[full * block_bytes:], b[full * block_bytes:]):
        changed.append(full)
    return changed


def runs(indices: list[int]) -> list[list[int]]:
    """Sorted block indices as runs ``[first, end)``: ``[0, 1, 2, 7] -> [[0, 3], [7, 8]]``."""
    out: list[list[int]] = []
    for index in indices:
        if out and out[-1][1] == index:
            out[-1][1] += 1
        else:
            out.append([index, index + 1])
    return out
