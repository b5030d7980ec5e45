"""Weight transports: how a backend's new weights reach the rollout engines.

``push(backend, plane, version)`` sends the backend's current weights to every engine of the rollout
plane in service, tagged with the policy version, and returns the bytes moved; an engine that fails
meanwhile is quarantined by the router and the push goes on. ``catch_up(plane, engine)`` brings one
returning engine (e.g. restarted after a crash) to the last pushed weights before it serves again.
Engines apply an update as a whole between two decode steps.

Every push records what it sends before sending it, and every catch-up repeats until the engine holds
the last recorded version. The router re-admits an engine on the rollout loop right after its
catch-up returns, with no await in between, and a push reads the engines in service on that loop
too (``plane.post_all`` does). So a push that lands while an engine catches up reaches it one way or
the other: once a push returns, every engine in service holds its version.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any

import torch

from miles.engine.weights_io import broadcast_tensors, open_weight_group, tensor_bytes
from miles.errors import ConfigError

__all__ = ["InProcessTransport", "TensorTransport", "DiskTransport", "DistributedTransport", "AutoTransport"]


def _nbytes(weights: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


def _copy_to_local(plane: Any, weights: dict[str, torch.Tensor], version: int) -> int:
    """Every transport degrades to a plain copy for engines in this process."""
    for engine in plane.local_engines:
        engine.update_weights(weights, version)
    return _nbytes(weights)


def _in_service(plane: Any) -> list[Any]:
    """The engines in service, read on the rollout loop, where no re-admission is half done."""
    async def read() -> list[Any]:
        return plane.router.healthy

    return plane.run(read())


class InProcessTransport:
    """``in_process``: copies tensors into engines that live in this process."""

    def push(self, backend: Any, plane: Any, version: int) -> int:
        if plane.remote:
            raise ConfigError("rollout.weight_sync: 'in_process' needs in-process engines (rollout.engine.num_engines=0); "
                              "use tensor, disk or distributed for engines served over HTTP")
        return _copy_to_local(plane, backend.export_weights(), version)

    async def catch_up(self, plane: Any, engine: Any) -> None:
        pass


class TensorTransport:
    """``tensor``: safetensors bytes posted to ``/update_weights_from_tensor`` of every engine."""

    def __init__(self) -> None:
        self._last: tuple[bytes, int] | None = None

    def push(self, backend: Any, plane: Any, version: int) -> int:
        weights = backend.export_weights()
        if not plane.remote:
            return _copy_to_local(plane, weights, version)
        self._last = (tensor_bytes(weights), version)
        plane.post_all("/update_weights_from_tensor", self._last[0], params={"weight_version": str(version)})
        return _nbytes(weights)

    async def catch_up(self, plane: Any, engine: Any) -> None:
        # Repeat if a push landed while this engine was catching up (it was not yet in service).
        while (last := self._last) is not None and engine.weight_version != last[1]:
            await plane.router.post(engine, "/update_weights_from_tensor", last[0],
                                    params={"weight_version": str(last[1])})


class DiskTransport:
    """``disk``: the backend writes an HF checkpoint, engines load it with ``/update_weights_from_disk``."""

    def __init__(self, dir: str | None = None, keep: int = 2) -> None:
        self.dir = Path(dir) if dir else Path(tempfile.mkdtemp(prefix="miles-weights-"))
        self.keep = max(1, keep)
        self._written: list[Path] = []
        self._last: dict[str, Any] | None = None

    def push(self, backend: Any, plane: Any, version: int) -> int:
        path = self.dir / f"v{version:08d}"
        backend.save_pretrained(str(path))
        self._written.append(path)
        self._last = {"model_path": str(path), "weight_version": version}
        if plane.remote:
            plane.post_all("/update_weights_from_disk", self._last)
        else:
            from miles.models import load_model

            _copy_to_local(plane, load_model(path).state_dict(), version)
        while len(self._written) > self.keep:
            shutil.rmtree(self._written.pop(0), ignore_errors=True)
        return sum(f.stat().st_size for f in path.glob("*.safetensors"))

    async def catch_up(self, plane: Any, engine: Any) -> None:
        while (last := self._last) is not None and engine.weight_version != last["weight_version"]:
            await plane.router.post(engine, "/update_weights_from_disk", last)


class DistributedTransport:
    """``distributed``: one broadcast from this process (rank 0) to every engine over a gloo group
    (NCCL on GPU); the group is formed again whenever the engines in service change. If an engine
    fails while the group forms or during the broadcast, the group is dropped and that push's weights
    go to the engines still in service as tensors; a returning engine catches up with tensors too."""

    def __init__(self, master_address: str = "127.0.0.1", timeout_s: float = 120.0) -> None:
        self.master_address = master_address
        self.timeout_s = timeout_s
        self._group: Any = None
        self._members: tuple[tuple[str, int], ...] = ()
        self._last: tuple[dict[str, torch.Tensor], int] | None = None

    def _ensure_group(self, plane: Any, engines: list[Any]) -> None:
        members = tuple((e.url, e.incarnation) for e in engines)  # a restarted engine has left the old group
        if self._group is not None and members == self._members:
            return
        self._group, self._members = None, ()
        with socket.socket() as s:
            s.bind((self.master_address, 0))
            port = s.getsockname()[1]

        async def join_all() -> list[Any]:
            return await asyncio.gather(*(plane.router.post(e, "/init_weights_update_group", {
                "master_address": self.master_address, "master_port": port, "rank_offset": i,
                "world_size": len(engines) + 1, "backend": "gloo", "group_name": "miles"}, self.timeout_s)
                for i, e in enumerate(engines)))

        joined = asyncio.run_coroutine_threadsafe(join_all(), plane.aio.loop)
        group = open_weight_group(self.master_address, port, 0, len(engines) + 1, timeout_s=self.timeout_s)
        joined.result(self.timeout_s)
        self._group, self._members = group, members

    def push(self, backend: Any, plane: Any, version: int) -> int:
        weights = backend.export_weights()
        if not plane.remote:
            return _copy_to_local(plane, weights, version)
        self._last = ({k: v.detach().clone() for k, v in weights.items()}, version)
        engines = _in_service(plane)
        posted = None
        try:
            self._ensure_group(plane, engines)
            tensors = [t.detach().contiguous() for t in weights.values()]
            body = {"names": list(weights), "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
                    "shapes": [list(t.shape) for t in tensors], "group_name": "miles", "weight_version": version}
            posted = asyncio.run_coroutine_threadsafe(
                plane.router.post_all("/update_weights_from_distributed", body, self.timeout_s, engines=engines),
                plane.aio.loop)
            broadcast_tensors(self._group, tensors)
            posted.result(self.timeout_s)
        except Exception:
            if posted is not None:
                posted.cancel()  # engines left waiting in the broken broadcast answer nobody
            self._group, self._members = None, ()
            plane.post_all("/update_weights_from_tensor", tensor_bytes(weights),
                           params={"weight_version": str(version)})
        return _nbytes(weights)

    async def catch_up(self, plane: Any, engine: Any) -> None:
        while (last := self._last) is not None and engine.weight_version != last[1]:
            await plane.router.post(engine, "/update_weights_from_tensor", tensor_bytes(last[0]),
                                    params={"weight_version": str(last[1])})


class AutoTransport:
    """``auto`` (the default): ``in_process`` for an in-process engine, ``tensor`` for engines over HTTP."""

    def __init__(self) -> None:
        self._local, self._remote = InProcessTransport(), TensorTransport()

    def _pick(self, plane: Any) -> Any:
        return self._remote if plane.remote else self._local

    def push(self, backend: Any, plane: Any, version: int) -> int:
        return self._pick(plane).push(backend, plane, version)

    async def catch_up(self, plane: Any, engine: Any) -> None:
        await self._remote.catch_up(plane, engine)
