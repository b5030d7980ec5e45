"""The ``shm`` and ``tensor`` transports with ``delta: true``: each push sends only the blocks of the weights that
changed since the last one to every engine that holds the last one, and the whole weights to the others. The
format, the checksums and the catch-up rule: :mod:`miles.weights.delta`."""

from __future__ import annotations

import asyncio
import logging
import struct
import threading
from dataclasses import dataclass
from typing import Any

from miles.errors import ConfigError, EngineRequestError
from miles.lazy import lazy_module
from miles.weights.delta import (
    MAX_BLOCK_BYTES, block_checksums, changed_blocks, encode_blocks, raw_bytes, runs, set_checksum,
)
from miles.weights.fleet import Endpoint, Engines
from miles.weights.lora import is_adapter_payload
from miles.weights.shm import HEADER, MAGIC, SHM_DTYPES, SHM_PATH, WRITING, WeightFile, _view
from miles.weights.transports import (
    AutoTransport, SharedMemoryTransport, TensorTransport, _copy_to_local, _refuse_sglang, post_each,
)
from miles.weights.wire import tensor_bytes

torch = lazy_module("torch")

__all__ = ["DeltaSharedMemoryTransport", "DeltaTensorTransport", "DeltaAutoTransport", "DeltaWeightFile",
           "shm_transport", "tensor_transport", "auto_transport"]

log = logging.getLogger(__name__)
TENSOR_PATH = "/update_weights_from_tensor"

class DeltaWeightFile(WeightFile):
    """The shm transport's file, with views of what it holds and a write of changed blocks only."""

    def views(self, descriptor: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The file's tensors (no copy) as ``descriptor`` lays them out."""
        return {name: _view(self._base, offset, SHM_DTYPES[dtype], tuple(shape))
                for name, dtype, shape, offset in zip(descriptor["names"], descriptor["dtypes"],
                                                      descriptor["shapes"], descriptor["offsets"])}

    def write_blocks(self, weights: dict[str, torch.Tensor], descriptor: dict[str, Any],
                     changed: dict[str, list[int]], block_bytes: int) -> None:
        """Rewrite only the ``changed`` blocks (by tensor) under the seqlock; the rest already holds ``weights``."""
        sequence = descriptor["sequence"]
        HEADER.pack_into(self._mmap, 0, MAGIC, sequence - 1, WRITING)  # odd: being written
        views = self.views(descriptor)
        for name, indices in changed.items():
            source, target = raw_bytes(weights[name]), raw_bytes(views[name])
            for first, end in runs(indices):
                span = slice(first * block_bytes, end * block_bytes)
                target[span].copy_(source[span])
        struct.pack_into("<q", self._mmap, 16, descriptor["weight_version"])
        struct.pack_into("<Q", self._mmap, 8, sequence)  # last: the write is complete
        self._sequence = sequence


@dataclass
class _Base:
    """What the file holds after its last complete write: a delta applies to it."""

    layout: list[tuple[str, str, tuple[int, ...]]]  # name, dtype, shape of each tensor, in order
    path: str | None
    sequence: int
    version: int
    sums: dict[str, torch.Tensor]  # each tensor's block checksums
    checksum: str


def _layout(weights: dict[str, torch.Tensor]) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(name, str(t.dtype), tuple(t.shape)) for name, t in weights.items()]


def _contiguous(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.detach().contiguous() for name, t in weights.items()}


class _Counted:
    """The counts of a delta transport (see :class:`DeltaSharedMemoryTransport`) and a step's metrics of them."""

    def _start_counting(self) -> None:
        self.stats = {"delta_posts": 0, "full_posts": 0, "full_catch_ups": 0, "changed_bytes": 0, "total_bytes": 0}
        self._reported: dict[str, int] = {}  # stats at the last metrics()

    def metrics(self) -> dict[str, float]:
        """``stats`` since the last call, under ``weight_sync/``, and the share of the weights' bytes the pushes
        rewrote (``changed_frac``): a step's metrics."""
        since = {key: value - self._reported.get(key, 0) for key, value in self.stats.items()}
        self._reported = dict(self.stats)
        return {**{f"weight_sync/{key}": float(value) for key, value in since.items()},
                "weight_sync/changed_frac": since["changed_bytes"] / since["total_bytes"] if since["total_bytes"]
                else 0.0}


async def _post_delta(plane: Engines, engine: Endpoint, path: str, body: dict[str, Any] | bytes,
                      params: dict[str, str] | None = None) -> bool:
    """Whether ``engine`` applied the delta; if not (it says why: 409 with ``full_push_needed``), it gets the whole
    weights next, through the router, which quarantines it if it fails."""
    try:
        await plane.router.post(engine, path, body, params=params)
    except EngineRequestError as exc:  # 400: a malformed delta, or weights a full push would refuse too
        log.warning("miles: %s refused a delta (%s); it gets the whole weights", engine.url, exc)
        return False
    except Exception as exc:  # 409 (not the delta's base), or it failed: the full push tells
        log.info("miles: %s took no delta (%s: %s); it gets the whole weights", engine.url, type(exc).__name__, exc)
        return False
    return True


class DeltaSharedMemoryTransport(_Counted, SharedMemoryTransport):
    """``shm`` with ``delta: true``: the blocks that changed since the last push, for engines that hold it; the
    whole file for the others (see the module's docstring). ``stats`` counts, since the start: ``delta_posts``
    (engines that took a delta), ``full_posts`` (engines sent the whole weights because no delta was possible: the
    first push, a new layout, adapters), ``full_catch_ups`` (engines sent the whole weights because they could not
    take the delta: another version, a checksum mismatch, a refusal, a re-admission), ``changed_bytes`` and
    ``total_bytes`` (what the pushes rewrote in the file, and the weights' size)."""

    def __init__(self, block_kib: int = 1024, full_above: float = 0.5) -> None:
        super().__init__()
        self._file = DeltaWeightFile()
        self.block_bytes, self.full_above = block_kib * 1024, full_above
        self._base: _Base | None = None
        self._delta: dict[str, Any] | None = None  # the delta section of the last push (None: it was full)
        self._start_counting()

    def _send(self, weights: dict[str, torch.Tensor], plane: Engines, version: int) -> int:
        if plane.remote:
            weights = _contiguous(weights)
        before = self.stats["changed_bytes"]
        super()._send(weights, plane, version)
        return self.stats["changed_bytes"] - before if plane.remote else _nbytes(weights)

    def _write(self, weights: dict[str, torch.Tensor], version: int) -> None:
        base, self._base, self._delta = self._base, None, None  # a write that fails leaves no base
        nbytes = _nbytes(weights)
        self.stats["total_bytes"] += nbytes
        if is_adapter_payload(weights):  # adapters are small, and the engine merges them: sent whole
            super()._write(weights, version)
            self.stats["changed_bytes"] += nbytes
            return
        layout = _layout(weights)
        if (base is None or base.layout != layout or base.path != self._file.path or base.sequence != self._written
                or self._last is None):
            super()._write(weights, version)
            self.stats["changed_bytes"] += nbytes
            sums = {name: block_checksums(t, self.block_bytes) for name, t in weights.items()}
            self._base = _Base(layout, self._file.path, self._written, version, sums, set_checksum(sums))
            return
        descriptor = self._file.prepare(weights, version)  # the same layout: the same file
        views = self._file.views(descriptor)
        changed = {name: found for name, t in weights.items() if (found := changed_blocks(t, views[name],
                                                                                           self.block_bytes))}
        sums = dict(base.sums)
        for name, indices in changed.items():
            sums[name] = _updated_sums(base.sums[name], weights[name], indices, self.block_bytes)
        self._last = descriptor
        try:
            self._file.write_blocks(weights, descriptor, changed, self.block_bytes)
        except BaseException:
            self._last = None  # the file holds no version now
            raise
        self._written = descriptor["sequence"]
        checksum = set_checksum(sums)
        changed_bytes = sum(_span_bytes(weights[n], i, self.block_bytes) for n, i in changed.items())
        self.stats["changed_bytes"] += changed_bytes
        if changed_bytes <= self.full_above * nbytes:  # else the whole file: no check of the engine's weights
            self._delta = {"base_version": base.version, "base_checksum": base.checksum, "checksum": checksum,
                           "block_bytes": self.block_bytes, "blocks": {n: runs(i) for n, i in changed.items()}}
        self._base = _Base(layout, self._file.path, self._written, version, sums, checksum)

    async def _post_each(self, plane: Engines, descriptor: dict[str, Any]) -> list[tuple[Any, EngineRequestError]]:
        """The delta to each engine in service that holds its base, the whole file to the others and to those
        that refuse the delta; returns the refusals of the whole file, by engine."""
        delta = self._delta

        async def send(engine: Endpoint) -> None:
            if delta is not None and engine.weight_version == delta["base_version"]:
                if await _post_delta(plane, engine, SHM_PATH, {**descriptor, "delta": delta}):
                    self.stats["delta_posts"] += 1
                    return
            self.stats["full_posts" if delta is None else "full_catch_ups"] += 1
            await plane.router.post_all(SHM_PATH, descriptor, engines=[engine])

        return await post_each(plane, send)

    async def catch_up(self, plane: Engines, engine: Endpoint) -> None:
        if (last := self._last) is not None and engine.weight_version != last["weight_version"]:
            self.stats["full_catch_ups"] += 1
        await super().catch_up(plane, engine)

    def close(self) -> None:
        self._base = self._delta = None
        super().close()


def _updated_sums(sums: torch.Tensor, tensor: torch.Tensor, indices: list[int], block_bytes: int) -> torch.Tensor:
    """``sums`` with the checksums of the blocks ``indices`` of ``tensor`` computed again."""
    sums, raw = sums.clone(), raw_bytes(tensor)
    for first, end in runs(indices):
        span = raw[first * block_bytes: end * block_bytes]
        sums[first:end] = block_checksums(span, block_bytes).to(sums.device)
    return sums


def _span_bytes(tensor: torch.Tensor, indices: list[int], block_bytes: int) -> int:
    size = tensor.numel() * tensor.element_size()
    return sum(min(block_bytes, size - i * block_bytes) for i in indices)


def _nbytes(weights: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


class DeltaTensorTransport(_Counted, TensorTransport):
    """``tensor`` with ``delta: true``: safetensors bytes of the blocks that changed since the last push (the delta
    section in their metadata) to the engines that hold it, the whole weights to the others; counted as
    :class:`DeltaSharedMemoryTransport` counts. The trainer keeps a copy of the last pushed weights to compare
    with (each push replaces the tensors that changed, so a catch-up reads a version that is never written again)
    and serialises the whole weights only when an engine needs them."""

    def __init__(self, block_kib: int = 1024, full_above: float = 0.5) -> None:
        super().__init__()
        self.block_bytes, self.full_above = block_kib * 1024, full_above
        self._base: _Base | None = None
        self._snapshot: tuple[dict[str, torch.Tensor], int] | None = None  # the last pushed weights, version
        self._full: tuple[Any, bytes] | None = None  # (snapshot, its safetensors bytes), made on first need
        self._full_lock = threading.Lock()
        self._start_counting()

    def _send(self, weights: dict[str, torch.Tensor], plane: Engines, version: int) -> int:
        if not plane.remote:
            return _copy_to_local(plane, weights, version)
        _refuse_sglang("tensor", plane.router.engines)
        weights = _contiguous(weights)
        base, self._base = self._base, None
        nbytes, layout = _nbytes(weights), _layout(weights)
        self.stats["total_bytes"] += nbytes
        section, changed_bytes = None, nbytes
        if is_adapter_payload(weights) or base is None or base.layout != layout or self._snapshot is None:
            held = {name: t.to("cpu", copy=True) for name, t in weights.items()}
            if not is_adapter_payload(weights):  # adapters are small: always whole, and never a base
                sums = {name: block_checksums(t, self.block_bytes) for name, t in held.items()}
                self._base = _Base(layout, None, 0, version, sums, set_checksum(sums))
        else:
            old = self._snapshot[0]
            changed = {name: found for name, t in weights.items()
                       if (found := changed_blocks(t, old[name], self.block_bytes))}
            sums = {**base.sums, **{name: _updated_sums(base.sums[name], weights[name], indices, self.block_bytes)
                                    for name, indices in changed.items()}}
            held = {**old, **{name: weights[name].to("cpu", copy=True) for name in changed}}
            checksum = set_checksum(sums)
            changed_bytes = sum(_span_bytes(weights[n], i, self.block_bytes) for n, i in changed.items())
            if changed_bytes <= self.full_above * nbytes:  # else the whole weights: no check of the engine's
                section = {"base_version": base.version, "base_checksum": base.checksum, "checksum": checksum,
                           "block_bytes": self.block_bytes, "blocks": {n: runs(i) for n, i in changed.items()}}
            self._base = _Base(layout, None, 0, version, sums, checksum)
        self.stats["changed_bytes"] += changed_bytes
        self._snapshot = snapshot = (held, version)  # recorded before it is sent: catch-ups bring this version
        body = None if section is None else encode_blocks(weights, section)
        refused = plane.run(self._post_each(plane, snapshot, body, section))
        if refused:
            raise refused[0][1]  # the weights do not fit the engine (as with every transport)
        return changed_bytes

    def _full_bytes(self, snapshot: tuple[dict[str, torch.Tensor], int]) -> bytes:
        """The safetensors bytes of the whole weights of ``snapshot`` (made once per snapshot)."""
        with self._full_lock:
            if self._full is None or self._full[0] is not snapshot:
                self._full = (snapshot, tensor_bytes(snapshot[0]))
            return self._full[1]

    async def _post_each(self, plane: Engines, snapshot: tuple[dict[str, torch.Tensor], int], body: bytes | None,
                         section: dict[str, Any] | None) -> list[tuple[Any, EngineRequestError]]:
        """The delta to each engine in service that holds its base, the whole weights to the others and to those
        that refuse the delta; returns the refusals of the whole weights, by engine."""
        params = {"weight_version": str(snapshot[1])}

        async def send(engine: Endpoint) -> None:
            if section is not None and engine.weight_version == section["base_version"]:
                if await _post_delta(plane, engine, TENSOR_PATH, body, params):
                    self.stats["delta_posts"] += 1
                    return
            self.stats["full_posts" if section is None else "full_catch_ups"] += 1
            full = await asyncio.get_running_loop().run_in_executor(None, self._full_bytes, snapshot)
            await plane.router.post_all(TENSOR_PATH, full, params=params, engines=[engine])

        return await post_each(plane, send)

    async def catch_up(self, plane: Engines, engine: Endpoint) -> None:
        # Repeat if a push landed while this engine was catching up (it was not yet in service).
        while (snapshot := self._snapshot) is not None and engine.weight_version != snapshot[1]:
            self.stats["full_catch_ups"] += 1
            body = await asyncio.get_running_loop().run_in_executor(None, self._full_bytes, snapshot)
            await plane.router.post(engine, TENSOR_PATH, body, params={"weight_version": str(snapshot[1])})

    def close(self) -> None:
        """Drop the copy of the last weights (an engine that returns after this is not caught up)."""
        self._base = self._snapshot = self._full = None


class DeltaAutoTransport(AutoTransport):
    """``auto`` with ``delta: true``: its ``shm`` and ``tensor`` send deltas (a push that switches from one to the
    other is whole for the engines that then hold another version than the new one's base)."""

    def __init__(self, block_kib: int = 1024, full_above: float = 0.5) -> None:
        super().__init__()
        self._shm = DeltaSharedMemoryTransport(block_kib, full_above)
        self._tensor = DeltaTensorTransport(block_kib, full_above)

    def metrics(self) -> dict[str, float]:
        """Both transports' step metrics, added up."""
        shm, tensor = self._shm.metrics(), self._tensor.metrics()
        total = {key: shm[key] + tensor[key] for key in shm}
        sent = total["weight_sync/total_bytes"]
        total["weight_sync/changed_frac"] = total["weight_sync/changed_bytes"] / sent if sent else 0.0
        return total


def auto_transport(delta: bool = False, block_kib: int = 1024, full_above: float = 0.5) -> AutoTransport:
    """``auto``; with ``delta: true`` its ``shm`` and ``tensor`` send only what changed
    (:class:`DeltaAutoTransport`)."""
    _delta_options(delta, block_kib, full_above)
    return DeltaAutoTransport(block_kib, full_above) if delta else AutoTransport()


def _delta_options(delta: Any, block_kib: Any, full_above: Any) -> None:
    if not isinstance(delta, bool):
        raise ConfigError(f"rollout.weight_sync.delta: expected true or false, got {delta!r}")
    if not isinstance(block_kib, int) or isinstance(block_kib, bool) or not 1 <= block_kib <= MAX_BLOCK_BYTES >> 10:
        raise ConfigError(f"rollout.weight_sync.block_kib: expected a whole number of KiB from 1 to "
                          f"{MAX_BLOCK_BYTES >> 10}, got {block_kib!r}")
    if isinstance(full_above, bool) or not isinstance(full_above, (int, float)) or not 0 <= full_above <= 1:
        raise ConfigError(f"rollout.weight_sync.full_above: expected a share of the weights' bytes in [0, 1] above "
                          f"which a push goes whole, got {full_above!r}")


def tensor_transport(delta: bool = False, block_kib: int = 1024, full_above: float = 0.5) -> TensorTransport:
    """``tensor``: the whole weights every push; with ``delta: true``, only the blocks of ``block_kib`` KiB that
    changed since the version an engine holds (:class:`DeltaTensorTransport`)."""
    _delta_options(delta, block_kib, full_above)
    return DeltaTensorTransport(block_kib, full_above) if delta else TensorTransport()


def shm_transport(delta: bool = False, block_kib: int = 1024, full_above: float = 0.5) -> SharedMemoryTransport:
    """``shm``: the whole weights every push; with ``delta: true``, only the blocks of ``block_kib`` KiB that
    changed since the version an engine holds (:class:`DeltaSharedMemoryTransport`)."""
    _delta_options(delta, block_kib, full_above)
    return DeltaSharedMemoryTransport(block_kib, full_above) if delta else SharedMemoryTransport()


def _check_args(args: dict[str, Any]) -> None:
    """Config validation (:class:`miles.hookspecs.ChecksArgs`): the delta options, before anything starts."""
    _delta_options(args.get("delta", False), args.get("block_kib", 1024), args.get("full_above", 0.5))


for _factory in (auto_transport, tensor_transport, shm_transport):
    _factory.check_args = _check_args  # type: ignore[attr-defined]
