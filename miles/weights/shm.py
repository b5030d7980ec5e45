"""The shared-memory weight file of the ``shm`` transport: where it lives, its layout, and its header.

The trainer keeps one file ``/dev/shm/miles-weights-*``, rewrites it for every push, and sends each engine
on the same machine a small JSON descriptor (``/update_weights_from_shm``); the engine maps the file
read-only and copies the tensors out, so the weights cross no socket. The file is a 64-byte header, then
every tensor at an offset aligned to 64 bytes. The header::

    magic b"MILESWT1" (8 bytes) | sequence (uint64) | weight_version (int64) | zeros up to 64 bytes

is a seqlock. Before it touches a tensor the writer makes ``sequence`` odd and ``weight_version`` -1
("being written"); after the last one it writes the version, then the next even ``sequence``. A reader
compares the header with its descriptor before and after it copies: a mismatch means the file was
rewritten meanwhile (the engine answers 409; retry with the new descriptor).

A file is never shrunk while an engine may have it mapped (reading past the end of a mapping kills the
process): when the total size changes the writer unlinks the file and creates one with a new name.

:func:`host_id` names this machine; the ``auto`` transport compares the engine's (in ``/server_info``)
with its own to know whether the engine can open the file at all.
"""

from __future__ import annotations

import mmap
import os
import secrets
import socket
import stat
import struct
import warnings
from dataclasses import dataclass
from typing import Any

from miles.lazy import lazy_module
from miles.weights.wire import DTYPES, Dtypes

torch = lazy_module("torch")

__all__ = ["SHM_DIR", "PREFIX", "SHM_PATH", "WeightFile", "MappedWeightFile", "Descriptor", "parse_descriptor",
           "check_path", "host_id"]

SHM_DIR = "/dev/shm"
PREFIX = "miles-weights-"
SHM_PATH = "/update_weights_from_shm"
MAGIC = b"MILESWT1"
HEADER = struct.Struct("<8sQq")  # magic, sequence, weight_version
HEADER_BYTES = 64
ALIGN = 64
WRITING = -1  # the header's weight_version while the tensors are being written
# floating point (what weight updates carry), the integer and bool buffers a state dict may hold, and the float8
# values and scales of a low-precision stored form (rollout.precision)
SHM_DTYPES = Dtypes((*DTYPES, "int64", "int32", "int16", "int8", "uint8", "bool", "float8_e4m3fn", "float8_e8m0fnu"))


def host_id() -> str | None:
    """This machine's identity: the kernel's boot id (shared by every container on the host) and the host
    name (usually not); None where there is no boot id (not Linux), where /dev/shm is not shared anyway."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        return None
    return f"{boot_id}/{socket.gethostname()}"


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    count = 1
    for size in shape:
        count *= size
    return count * dtype.itemsize


def _view(base: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor of ``dtype`` and ``shape`` at ``offset`` of the file's bytes (no copy)."""
    return base[offset:offset + _nbytes(shape, dtype)].view(dtype).view(shape)


def _header(buffer: Any) -> tuple[bytes, int, int]:
    return HEADER.unpack_from(buffer, 0)


# -- the trainer's side --------------------------------------------------------------------------------


class WeightFile:
    """The file one transport writes: created and mapped once, reused while the total size stays the same,
    unlinked by :meth:`close`."""

    def __init__(self, directory: str = SHM_DIR) -> None:
        self.directory = directory
        self._stem = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        self._generation = 0
        self.path: str | None = None
        self._mmap: mmap.mmap | None = None
        self._base: torch.Tensor | None = None
        self._sequence = 0  # even: the last write is complete

    def prepare(self, weights: dict[str, torch.Tensor], version: int) -> dict[str, Any]:
        """The descriptor of writing ``weights`` next (the file made to fit them); :meth:`write` writes them.
        An OSError means /dev/shm cannot hold them (missing, or too small: a container's default is 64 MiB)."""
        dtypes = []
        for name, tensor in weights.items():
            if (dtype_name := SHM_DTYPES.name(tensor.dtype)) is None:
                raise ValueError(f"shm: {name} has dtype {tensor.dtype}; expected one of {', '.join(SHM_DTYPES)}")
            dtypes.append(dtype_name)
        offsets, end = [], HEADER_BYTES
        for tensor in weights.values():
            offsets.append(end)
            end = _aligned(end + tensor.numel() * tensor.element_size())
        self._fit(end)
        return {"path": self.path, "names": list(weights), "dtypes": dtypes,
                "shapes": [list(t.shape) for t in weights.values()], "offsets": offsets,
                "sequence": self._sequence + 2, "weight_version": int(version)}

    def write(self, weights: dict[str, torch.Tensor], descriptor: dict[str, Any]) -> None:
        """Write ``weights`` as ``descriptor`` (from :meth:`prepare`) says, under the seqlock."""
        sequence = descriptor["sequence"]
        HEADER.pack_into(self._mmap, 0, MAGIC, sequence - 1, WRITING)  # odd: being written
        for tensor, dtype, shape, offset in zip(weights.values(), descriptor["dtypes"], descriptor["shapes"],
                                                descriptor["offsets"]):
            _view(self._base, offset, SHM_DTYPES[dtype], tuple(shape)).copy_(tensor.detach())
        struct.pack_into("<q", self._mmap, 16, descriptor["weight_version"])
        struct.pack_into("<Q", self._mmap, 8, sequence)  # last: the write is complete
        self._sequence = sequence

    def read(self, descriptor: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        """A private copy of the tensors ``descriptor`` names, or None if the file is being or was rewritten
        (or replaced)."""
        mapped, base, expected = self._mmap, self._base, (descriptor["sequence"], descriptor["weight_version"])
        if mapped is None or base is None or self.path != descriptor["path"]:
            return None
        try:
            if _header(mapped)[1:] != expected:
                return None
            copies = {name: _view(base, offset, SHM_DTYPES[dtype], tuple(shape)).clone()
                      for name, dtype, shape, offset in zip(descriptor["names"], descriptor["dtypes"],
                                                            descriptor["shapes"], descriptor["offsets"])}
            return copies if _header(mapped)[1:] == expected else None
        except ValueError:  # unmapped meanwhile: a push replaced the file
            return None

    def _fit(self, size: int) -> None:
        if self._mmap is not None and len(self._mmap) == size:
            return
        self.close()
        self._generation += 1
        path = os.path.join(self.directory, f"{self._stem}-{self._generation}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # no room: ENOSPC now, rather than SIGBUS while writing
            self._mmap = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        self.path = path
        self._base = torch.frombuffer(self._mmap, dtype=torch.uint8)
        HEADER.pack_into(self._mmap, 0, MAGIC, self._sequence, WRITING)

    def close(self) -> None:
        """Unlink the file (an engine that still maps it keeps its pages until it maps another)."""
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        self._base, self.path = None, None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:  # a tensor from read() still views it: unmapped once that is gone
                pass
            self._mmap = None


# -- the engine's side ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Descriptor:
    """What ``/update_weights_from_shm`` reads; ``snapshot``: copy the tensors out and check the header
    before applying them, because the file may be rewritten meanwhile (a catch-up racing a push)."""

    path: str
    names: list[str]
    dtypes: list[torch.dtype]
    shapes: list[tuple[int, ...]]
    offsets: list[int]
    sequence: int
    weight_version: int
    snapshot: bool = False


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_path(path: Any) -> str:
    """``path`` if it names a file directly under /dev/shm whose name starts with ``miles-weights-``."""
    name = os.path.basename(path) if isinstance(path, str) else ""
    if not (name.startswith(PREFIX) and path == os.path.join(SHM_DIR, name)) or "\x00" in name:
        raise ValueError(f"path: expected a file directly under {SHM_DIR} whose name starts with {PREFIX!r}, "
                         f"got {path!r}")
    return path


def parse_descriptor(body: dict[str, Any]) -> Descriptor:
    """The descriptor of a ``/update_weights_from_shm`` body; a ValueError names the field."""
    missing = [k for k in ("path", "names", "dtypes", "shapes", "offsets", "sequence", "weight_version")
               if k not in body]
    if missing:
        raise ValueError(f"missing field(s): {', '.join(missing)}")
    path = check_path(body["path"])
    lists = {k: body[k] for k in ("names", "dtypes", "shapes", "offsets")}
    for key, value in lists.items():
        if not isinstance(value, list):
            raise ValueError(f"{key}: expected a list (one entry per tensor), got {type(value).__name__}")
    if len({len(v) for v in lists.values()}) > 1:
        raise ValueError("names, dtypes, shapes, offsets: expected lists of the same length, got "
                         + ", ".join(f"{len(v)} {k}" for k, v in lists.items()))
    names, dtypes, shapes, offsets = lists.values()
    if not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        raise ValueError("names: expected distinct tensor names (strings)")
    unknown = sorted({str(d) for d in dtypes if not isinstance(d, str) or d not in SHM_DTYPES})
    if unknown:
        raise ValueError(f"dtypes: expected names among {', '.join(SHM_DTYPES)}, got {', '.join(unknown)}")
    bad = [s for s in shapes if not isinstance(s, list) or not all(_is_int(d) and d >= 0 for d in s)]
    if bad:
        raise ValueError(f"shapes: expected lists of sizes >= 0, got {bad[0]!r}")
    bad = [o for o, d in zip(offsets, dtypes) if not _is_int(o) or o < HEADER_BYTES or o % SHM_DTYPES[d].itemsize]
    if bad:
        raise ValueError(f"offsets: expected byte offsets from {HEADER_BYTES} on, each a multiple of its dtype's "
                         f"size, got {bad[0]!r}")
    for key in ("sequence", "weight_version"):
        if not _is_int(body[key]) or body[key] < 0:
            raise ValueError(f"{key}: expected an integer >= 0, got {body[key]!r}")
    snapshot = body.get("snapshot", False)
    if not isinstance(snapshot, bool):
        raise ValueError(f"snapshot: expected true or false, got {snapshot!r}")
    return Descriptor(path, names, [SHM_DTYPES[d] for d in dtypes], [tuple(s) for s in shapes], offsets,
                      body["sequence"], body["weight_version"], snapshot)


class MappedWeightFile:
    """One mapping of the trainer's file, read-only. The engine keeps the last one between updates (no page
    faults the next time) and maps again when another file, or one of another size, is named."""

    def __init__(self, path: str, key: tuple[int, int, int], mapped: mmap.mmap) -> None:
        self.path, self.key, self._mmap = path, key, mapped
        with warnings.catch_warnings():  # read-only memory: the views are only ever read
            warnings.simplefilter("ignore", UserWarning)
            self._base = torch.frombuffer(mapped, dtype=torch.uint8)

    @classmethod
    def open(cls, path: str, cached: "MappedWeightFile | None" = None) -> "MappedWeightFile":
        """The mapping of ``path``: ``cached`` if it maps that very file; a ValueError names the field."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise ValueError(f"path: cannot open {path} ({exc.strerror}); the engine must run on the trainer's "
                             f"machine and share its {SHM_DIR}") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"path: {path} is not a regular file")
            key = (st.st_dev, st.st_ino, st.st_size)
            if cached is not None and (cached.path, cached.key) == (path, key):
                return cached
            if st.st_size < HEADER_BYTES:
                raise ValueError(f"path: {path} is too small to be a weight file ({st.st_size} bytes)")
            mapped = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        if _header(mapped)[0] != MAGIC:
            mapped.close()
            raise ValueError(f"path: {path} is not a Miles weight file (no {MAGIC.decode()} header)")
        return cls(path, key, mapped)  # the old mapping is unmapped with its last view

    def tensors(self, d: Descriptor) -> dict[str, torch.Tensor]:
        """Views of the tensors ``d`` names (no copy); a ValueError names the fields that do not fit the file."""
        size = len(self._mmap)
        for name, dtype, shape, offset in zip(d.names, d.dtypes, d.shapes, d.offsets):
            if offset + _nbytes(shape, dtype) > size:
                raise ValueError(f"offsets, shapes: {name} ({_nbytes(shape, dtype)} bytes at {offset}) goes past "
                                 f"the end of {d.path} ({size} bytes)")
        return {name: _view(self._base, offset, dtype, shape)
                for name, dtype, shape, offset in zip(d.names, d.dtypes, d.shapes, d.offsets)}

    def rewritten(self, d: Descriptor) -> str | None:
        """Why the file no longer holds what ``d`` describes (being rewritten, or rewritten), or None."""
        _, sequence, version = _header(self._mmap)
        if (sequence, version) == (d.sequence, d.weight_version):
            return None
        state = "being written" if sequence % 2 else f"sequence {sequence}, weight_version {version}"
        return (f"{d.path} was rewritten while reading (its header says {state}; the descriptor says sequence "
                f"{d.sequence}, weight_version {d.weight_version}): retry with the current descriptor")
