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
import atexit
import logging
import shutil
import tempfile
from pathlib import Path
from collections.abc import Awaitable, Callable
from typing import Any

from miles.errors import ConfigError, EngineRequestError
from miles.lazy import lazy_module
from miles.ports import free_port
from miles.weights.fleet import Endpoint, Engines
from miles.weights.shm import SHM_DIR, SHM_PATH, WeightFile, host_id
from miles.weights.wire import broadcast_tensors, open_weight_group, tensor_bytes

aiohttp = lazy_module("aiohttp")
torch = lazy_module("torch")

__all__ = ["InProcessTransport", "TensorTransport", "DiskTransport", "DistributedTransport", "SharedMemoryTransport",
           "SharedMemoryUnavailable", "AutoTransport"]

log = logging.getLogger(__name__)


def _nbytes(weights: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


def _copy_to_local(plane: Engines, weights: dict[str, torch.Tensor], version: int) -> int:
    """Every transport degrades to a plain copy for engines in this process."""
    for engine in plane.local_engines:
        engine.update_weights(weights, version)
    return _nbytes(weights)


def _sglang(engines: list[Endpoint]) -> list[Any]:
    """The engines among ``engines`` that are SGLang servers (``miles-sglang``): they take no safetensors bytes."""
    return [e for e in engines if e.meta.get("protocol") == "sglang"]


def _refuse_sglang(name: str, engines: list[Endpoint]) -> None:
    """SGLang's /update_weights_from_tensor takes handles to tensors in the sender's memory (its
    MultiprocessingSerializer: CUDA IPC or shared-memory file descriptors), not bytes, and it has no
    /update_weights_from_shm: these transports cannot reach it."""
    if sglang := _sglang(engines):
        raise ConfigError(f"rollout.weight_sync: {name!r} cannot update SGLang servers "
                          f"({', '.join(e.url for e in sglang)}): SGLang's /update_weights_from_tensor takes handles "
                          f"to tensors in the sender's GPU memory, not safetensors bytes. Use disk (a checkpoint "
                          f"directory the servers can read) or distributed (a broadcast group), or auto (disk for "
                          f"SGLang servers)")


def _in_service(plane: Engines) -> list[Any]:
    """The engines in service, read on the rollout loop, where no re-admission is half done."""
    async def read() -> list[Any]:
        return plane.router.healthy

    return plane.run(read())


class InProcessTransport:
    """``in_process``: copies tensors into engines that live in this process."""

    exports_only = True  # a push reads only backend.export_weights(): it may send a snapshot later

    def push(self, backend: Any, plane: Engines, version: int) -> int:
        if plane.remote:
            raise ConfigError("rollout.weight_sync: 'in_process' needs in-process engines "
                              "(rollout.engine.num_engines=0); "
                              "use auto, shm, tensor, disk or distributed for engines served over HTTP")
        return _copy_to_local(plane, backend.export_weights(), version)

    async def catch_up(self, plane: Engines, engine: Endpoint) -> None:
        pass


class TensorTransport:
    """``tensor``: safetensors bytes posted to ``/update_weights_from_tensor`` of every engine."""

    exports_only = True  # a push reads only backend.export_weights(): it may send a snapshot later

    def __init__(self) -> None:
        self._last: tuple[bytes, int] | None = None

    def push(self, backend: Any, plane: Engines, version: int) -> int:
        return self._send(backend.export_weights(), plane, version)

    def _send(self, weights: dict[str, torch.Tensor], plane: Engines, version: int) -> int:
        if not plane.remote:
            return _copy_to_local(plane, weights, version)
        _refuse_sglang("tensor", plane.router.engines)
        self._last = (tensor_bytes(weights), version)
        plane.post_all("/update_weights_from_tensor", self._last[0], params={"weight_version": str(version)})
        return _nbytes(weights)

    async def catch_up(self, plane: Engines, engine: Endpoint) -> None:
        # Repeat if a push landed while this engine was catching up (it was not yet in service).
        while (last := self._last) is not None and engine.weight_version != last[1]:
            await plane.router.post(engine, "/update_weights_from_tensor", last[0],
                                    params={"weight_version": str(last[1])})


class DiskTransport:
    """``disk``: the backend writes an HF checkpoint, engines load it with ``/update_weights_from_disk``."""

    def __init__(self, dir: str | None = None, keep: int = 2) -> None:
        self._temporary = not dir  # a folder of its own, removed by close()
        self.dir = Path(dir) if dir else Path(tempfile.mkdtemp(prefix="miles-weights-"))
        self.keep = max(1, keep)
        self._written: list[Path] = []
        self._last: dict[str, Any] | None = None

    def push(self, backend: Any, plane: Engines, version: int) -> int:
        path = self.dir / f"v{version:08d}"
        backend.save_pretrained(str(path))
        self._written.append(path)
        # SGLang's weight_version is a string; the embedded engine takes both
        self._last = {"model_path": str(path), "weight_version": str(version)}
        if plane.remote:
            plane.post_all("/update_weights_from_disk", self._last)
        else:
            from miles.models.hf import load_weights

            _copy_to_local(plane, load_weights(path), version)
        while len(self._written) > self.keep:
            shutil.rmtree(self._written.pop(0), ignore_errors=True)
        return sum(f.stat().st_size for f in path.glob("*.safetensors"))

    async def catch_up(self, plane: Engines, engine: Endpoint) -> None:
        while (last := self._last) is not None and engine.weight_version != int(last["weight_version"]):
            await plane.router.post(engine, "/update_weights_from_disk", last)

    def close(self) -> None:
        """Remove the checkpoints of a folder made for them (one given in ``dir`` keeps its last ``keep``)."""
        if self._temporary:
            shutil.rmtree(self.dir, ignore_errors=True)


class DistributedTransport:
    """``distributed``: one broadcast from this process (rank 0) to every engine over a gloo group
    (NCCL on GPU); the group is formed again whenever the engines in service change. If an engine
    fails while the group forms or during the broadcast, the group is dropped and that push's weights
    go to the engines still in service as tensors; a returning engine catches up with tensors too."""

    exports_only = True  # a push reads only backend.export_weights(): it may send a snapshot later

    def __init__(self, master_address: str = "127.0.0.1", timeout_s: float = 120.0) -> None:
        self.master_address = master_address
        self.timeout_s = timeout_s
        self._group: Any = None
        self._members: tuple[tuple[str, int], ...] = ()
        self._last: tuple[dict[str, torch.Tensor], int] | None = None

    def _ensure_group(self, plane: Engines, engines: list[Endpoint]) -> None:
        members = tuple((e.url, e.incarnation) for e in engines)  # a restarted engine has left the old group
        if self._group is not None and members == self._members:
            return
        self._group, self._members = None, ()
        port = free_port(self.master_address)

        # The trainer is rank 0; an engine of tp_size ranks takes ranks rank_offset .. rank_offset + tp_size - 1
        # (SGLang's rank = rank_offset + tp_rank).
        sizes = [int(e.meta.get("tp_size", 1)) for e in engines]
        offsets = [1 + sum(sizes[:i]) for i in range(len(engines))]
        world_size = 1 + sum(sizes)

        async def join_all() -> list[Any]:
            return await asyncio.gather(*(plane.router.post(e, "/init_weights_update_group", {
                "master_address": self.master_address, "master_port": port, "rank_offset": offset,
                "world_size": world_size, "backend": "gloo", "group_name": "miles"}, self.timeout_s)
                for offset, e in zip(offsets, engines)))

        joined = plane.submit(join_all())
        group = open_weight_group(self.master_address, port, 0, world_size, timeout_s=self.timeout_s)
        joined.result(self.timeout_s)
        self._group, self._members = group, members

    def push(self, backend: Any, plane: Engines, version: int) -> int:
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
                    "shapes": [list(t.shape) for t in tensors], "group_name": "miles", "weight_version": str(version)}
            posted = plane.submit(
                plane.router.post_all("/update_weights_from_distributed", body, self.timeout_s, engines=engines))
            broadcast_tensors(self._group, tensors)
            posted.result(self.timeout_s)
        except Exception:
            if posted is not None:
                posted.cancel()  # engines left waiting in the broken broadcast answer nobody
            self._group, self._members = None, ()
            if _sglang(engines):  # they take no tensors: the failure stands
                raise
            plane.post_all("/update_weights_from_tensor", tensor_bytes(weights),
                           params={"weight_version": str(version)})
        return _nbytes(weights)

    async def catch_up(self, plane: Engines, engine: Endpoint) -> None:
        if _sglang([engine]):
            # No tensors for SGLang: it gets the last weights through a group of its own with this process.
            while (last := self._last) is not None and engine.weight_version != last[1]:
                await asyncio.get_running_loop().run_in_executor(None, self._broadcast_to, plane, engine, *last)
            return
        while (last := self._last) is not None and engine.weight_version != last[1]:
            await plane.router.post(engine, "/update_weights_from_tensor", tensor_bytes(last[0]),
                                    params={"weight_version": str(last[1])})

    def _broadcast_to(self, plane: Engines, engine: Endpoint, weights: dict[str, torch.Tensor], version: int) -> None:
        """One engine's catch-up by broadcast, in a group of its own (the shared group is formed again at the
        next push, since the engines in service changed)."""
        self._group, self._members = None, ()
        try:
            self._ensure_group(plane, [engine])
            tensors = [t.detach().contiguous() for t in weights.values()]
            body = {"names": list(weights), "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
                    "shapes": [list(t.shape) for t in tensors], "group_name": "miles", "weight_version": str(version)}
            posted = plane.submit(plane.router.post(engine, "/update_weights_from_distributed", body, self.timeout_s))
            broadcast_tensors(self._group, tensors)
            posted.result(self.timeout_s)
        finally:
            self._group, self._members = None, ()


async def post_each(plane: Engines, post: Callable[[Endpoint], Awaitable[Any]]) -> list[tuple[Any, EngineRequestError]]:
    """``post(engine)`` for every engine in service at once (read here, on the rollout loop), waiting for every
    answer; the engines that refused, with their refusal. No engine left in service raises the router's error."""
    if (error := plane.router.no_engine_left()) is not None:
        raise error

    async def one(engine: Endpoint) -> tuple[Any, EngineRequestError] | None:
        try:
            await post(engine)
        except EngineRequestError as exc:
            return engine, exc
        return None

    answers = await asyncio.gather(*(one(e) for e in plane.router.healthy))
    return [a for a in answers if a is not None]


class SharedMemoryUnavailable(ConfigError):
    """``shm`` cannot serve these ``engines`` (they cannot open the file), or with none named, cannot serve at
    all (/dev/shm missing or too small for the weights, a dtype it does not carry)."""

    def __init__(self, message: str, engines: list[Endpoint] = ()) -> None:
        super().__init__(message)
        self.engines = list(engines)


def _unreadable(refusal: EngineRequestError) -> bool:
    """Whether an engine refused the descriptor because it cannot open the file (another machine, another
    /dev/shm, another user): the engine names the field ``path``."""
    return str(refusal).startswith("path:")


async def _post_json(plane: Engines, engine: Endpoint, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """(HTTP status, answer) of one POST, whatever the status: a catch-up tells a 409 from a failure."""
    timeout = aiohttp.ClientTimeout(total=plane.router.request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.post(engine.url + path, json=body, headers=plane.router.headers) as resp:
            return resp.status, await resp.json(content_type=None)


class SharedMemoryTransport:
    """``shm``: for engines on this machine. A push writes the weights once into a file under /dev/shm (made
    and mapped once, reused while their total size stays the same) and posts a small JSON descriptor to
    ``/update_weights_from_shm`` of every engine in service; each copies the tensors out of its own read-only
    mapping. A catch-up may run while a push rewrites the file: the engine then answers 409 (the file's
    header changed while it read) and the catch-up posts again once the push has written it. The file is
    removed by :meth:`close`, or when the process exits."""

    exports_only = True  # a push reads only backend.export_weights(): it may send a snapshot later

    def __init__(self) -> None:
        self._file = WeightFile()
        self._last: dict[str, Any] | None = None  # the descriptor of the last push, recorded before its write
        self._written = 0  # the sequence of the last complete write
        self._at_exit = False

    def push(self, backend: Any, plane: Engines, version: int) -> int:
        return self._send(backend.export_weights(), plane, version)

    def _send(self, weights: dict[str, torch.Tensor], plane: Engines, version: int) -> int:
        if not plane.remote:
            return _copy_to_local(plane, weights, version)
        _refuse_sglang("shm", plane.router.engines)
        self._write(weights, version)
        refused = plane.run(self._post_each(plane, self._last))
        unreadable = [engine for engine, refusal in refused if _unreadable(refusal)]
        for _, refusal in refused:
            if not _unreadable(refusal):
                raise refusal  # the weights do not fit the engine (as with every transport)
        if unreadable:
            raise SharedMemoryUnavailable(
                f"rollout.weight_sync: shm needs every engine on this machine, sharing its {SHM_DIR}, but "
                f"{', '.join(e.url for e in unreadable)} cannot read the weights: {refused[0][1]}. "
                f"Use auto (shm for engines on this machine, tensor for the others) or tensor", unreadable)
        return _nbytes(weights)

    def _write(self, weights: dict[str, torch.Tensor], version: int) -> None:
        if not self._at_exit:  # a trainer that dies with an exception leaves no file behind
            atexit.register(self.close)
            self._at_exit = True
        try:
            descriptor = self._file.prepare(weights, version)
        except OSError as exc:
            raise SharedMemoryUnavailable(
                f"rollout.weight_sync: shm: {SHM_DIR} cannot hold the weights ({_nbytes(weights)} bytes): "
                f"{exc.strerror or exc}; give it room (a container's is 64 MiB unless started with --shm-size) "
                f"or use tensor") from exc
        except ValueError as exc:
            raise SharedMemoryUnavailable(f"rollout.weight_sync: {exc}; use tensor") from exc
        self._last = descriptor
        try:
            self._file.write(weights, descriptor)
        except BaseException:
            self._last = None  # the file holds no version now
            raise
        self._written = descriptor["sequence"]

    async def _post_each(self, plane: Engines, descriptor: dict[str, Any]) -> list[tuple[Any, EngineRequestError]]:
        """Post to every engine in service and wait for every answer, so that no engine still reads when the next
        push rewrites the file. An engine that fails is quarantined (``Router.post_all``); returns the refusals."""
        return await post_each(plane, lambda engine: plane.router.post_all(SHM_PATH, descriptor, engines=[engine]))

    async def _until_written(self, descriptor: dict[str, Any]) -> None:
        """Wait while a push writes the file ``descriptor`` describes (milliseconds to seconds)."""
        while self._last is descriptor and self._written < descriptor["sequence"]:
            await asyncio.sleep(0.005)

    async def catch_up(self, plane: Engines, engine: Endpoint) -> None:
        while (last := self._last) is not None and engine.weight_version != last["weight_version"]:
            complete = self._written >= last["sequence"]
            # snapshot: the engine copies the tensors out before it checks the header again and applies them
            status, answer = await _post_json(plane, engine, SHM_PATH, {**last, "snapshot": True})
            if status == 200:
                engine.weight_version = answer["weight_version"]
            elif status in (400, 409) and self._last is not last:
                continue  # a push rewrote (or replaced) the file meanwhile: post its descriptor
            elif status == 409 and not complete:
                await self._until_written(last)  # the push of this very descriptor was still writing it
            elif status == 400:
                raise EngineRequestError(answer.get("error", str(answer)) if isinstance(answer, dict) else answer)
            else:  # a 409 with no write under way is the engine's fault
                raise RuntimeError(f"{engine.url}{SHM_PATH} answered HTTP {status}: {answer}")

    async def catch_up_with_tensors(self, plane: Engines, engine: Endpoint) -> None:
        """Catch up an engine that cannot open the file: its tensors, copied out of the file (again if a push
        rewrote it meanwhile), go as safetensors bytes to ``/update_weights_from_tensor``."""
        loop = asyncio.get_running_loop()
        while (last := self._last) is not None and engine.weight_version != last["weight_version"]:
            await self._until_written(last)
            weights = await loop.run_in_executor(None, self._file.read, last)
            if weights is None:
                if self._last is last:
                    raise RuntimeError(f"the weight file of version {last['weight_version']} is gone (closed)")
                continue
            body = await loop.run_in_executor(None, tensor_bytes, weights)
            await plane.router.post(engine, "/update_weights_from_tensor", body,
                                    params={"weight_version": str(last["weight_version"])})

    def close(self) -> None:
        """Remove the file; engines keep the weights they loaded."""
        self._last = None
        self._file.close()
        if self._at_exit:
            atexit.unregister(self.close)
            self._at_exit = False


async def _server_info(plane: Engines, engine: Endpoint) -> dict[str, Any] | None:
    """The engine's ``/server_info`` ({} if it has none to give), or None if it could not be reached."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            async with session.get(engine.url + "/server_info", headers=plane.router.headers) as resp:
                info = await resp.json(content_type=None) if resp.status == 200 else {}
                return info if isinstance(info, dict) else {}
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None


class AutoTransport:
    """``auto`` (the default): ``in_process`` for in-process engines; for engines over HTTP, ``shm`` when every
    engine in service runs on this machine (its ``/server_info`` reports this machine's ``host_id``), else
    ``tensor``. Where an engine runs is asked once per engine (URL and incarnation). An engine that cannot open
    the file after all (a container with a /dev/shm of its own, another user) gets that push as tensors, and
    tensors from then on; so does every engine once /dev/shm cannot hold the weights."""

    @property
    def exports_only(self) -> bool:
        """Whether a push reads only backend.export_weights() (not with SGLang servers: it saves a checkpoint)."""
        return self._disk is None

    def use_disk(self) -> None:
        """Send checkpoints on disk (what SGLang servers take) from now on; the runner calls it for ``sglang``."""
        self._disk = self._disk or DiskTransport()

    def __init__(self) -> None:
        self._local, self._tensor, self._shm = InProcessTransport(), TensorTransport(), SharedMemoryTransport()
        self._disk: DiskTransport | None = None  # for SGLang servers, made on first use
        self._here: dict[tuple[str, int], bool] = {}  # (url, incarnation): whether it runs on this machine
        self._shm_works = True
        self._last: Any = None  # the transport of the last push

    def push(self, backend: Any, plane: Engines, version: int) -> int:
        if not plane.remote:
            return self._local.push(backend, plane, version)
        if self._disk is not None or _sglang(plane.router.engines):  # SGLang takes no tensor bytes, no shm file
            self.use_disk()
            self._last = self._disk
            return self._disk.push(backend, plane, version)
        weights = backend.export_weights()
        if self._shm_works and plane.run(self._all_here(plane)):
            self._last = self._shm  # before it posts: a catch-up from now on follows shm
            try:
                return self._shm._send(weights, plane, version)
            except SharedMemoryUnavailable as exc:
                log.warning("miles: rollout.weight_sync auto: shm failed, this push goes as tensors: %s", exc)
                for engine in exc.engines:
                    self._here[(engine.url, engine.incarnation)] = False
                self._shm_works = bool(exc.engines)
        self._last = self._tensor
        return self._tensor._send(weights, plane, version)

    async def _all_here(self, plane: Engines) -> bool:
        """Whether every engine in service runs on this machine (read on the rollout loop)."""
        engines = plane.router.healthy
        return bool(engines) and all(await asyncio.gather(*(self._is_here(plane, e) for e in engines)))

    async def _is_here(self, plane: Engines, engine: Endpoint) -> bool:
        key = (engine.url, engine.incarnation)
        if key not in self._here:
            info = await _server_info(plane, engine)
            if info is None:  # unreachable: not here this time, asked again next time
                return False
            mine = host_id()
            self._here[key] = mine is not None and info.get("host_id") == mine
        return self._here[key]

    async def catch_up(self, plane: Engines, engine: Endpoint) -> None:
        # Again if a push by the other transport began meanwhile: it may not reach this engine otherwise.
        while True:
            last = self._last
            if last is self._shm and await self._is_here(plane, engine):
                try:
                    await self._shm.catch_up(plane, engine)
                except EngineRequestError as exc:
                    if not _unreadable(exc):
                        raise
                    self._here[(engine.url, engine.incarnation)] = False
                    continue
            elif last is self._shm:
                await self._shm.catch_up_with_tensors(plane, engine)
            elif last is not None:
                await last.catch_up(plane, engine)
            if self._last is last:
                return

    def close(self) -> None:
        self._shm.close()
        if self._disk is not None:
            self._disk.close()
