"""Moving weights between processes: safetensors bytes over HTTP, and a gloo (NCCL on GPU) group.

``/update_weights_from_tensor`` carries ``serialized_named_tensors`` as base64 safetensors bytes
(SGLang's field name; its encoding here is safetensors rather than pickle, so a request cannot run
code). The distributed path builds its own process group from a TCP store, so it never touches the
default group a training backend may use.
"""

from __future__ import annotations

import base64
import datetime
from collections.abc import Iterable, Iterator, Mapping

from miles.lazy import lazy_module

torch = lazy_module("torch")
dist = lazy_module("torch.distributed")
safetensors_torch = lazy_module("safetensors.torch")

__all__ = ["DTYPES", "BROADCAST_DTYPES", "Dtypes", "tensor_bytes", "encode_named_tensors", "decode_named_tensors",
           "open_weight_group", "broadcast_tensors"]


class Dtypes(Mapping[str, "torch.dtype"]):
    """torch dtypes by name (``"bfloat16"`` -> ``torch.bfloat16``); torch is imported at the first lookup."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = tuple(names)

    def __getitem__(self, name: str) -> torch.dtype:
        if name not in self.names:
            raise KeyError(name)
        return getattr(torch, name)

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def name(self, dtype: torch.dtype) -> str | None:
        """The name of ``dtype`` when it is one of these, else None."""
        name = str(dtype).removeprefix("torch.")
        return name if name in self.names else None


DTYPES = Dtypes(("float32", "float16", "bfloat16", "float64"))
# what a broadcast may carry too: the integer and float8 tensors of a low-precision stored form (rollout.precision)
BROADCAST_DTYPES = Dtypes((*DTYPES, "int64", "int32", "int8", "uint8", "float8_e4m3fn", "float8_e8m0fnu"))


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    """Safetensors bytes of named tensors."""
    # clone: tied parameters (embeddings and LM head) share storage, which safetensors refuses
    return safetensors_torch.save({k: v.detach().cpu().clone() for k, v in tensors.items()})


def encode_named_tensors(tensors: dict[str, torch.Tensor]) -> str:
    """``serialized_named_tensors`` for the JSON form of ``/update_weights_from_tensor``."""
    return base64.b64encode(tensor_bytes(tensors)).decode()


def decode_named_tensors(payload: str) -> dict[str, torch.Tensor]:
    try:
        return safetensors_torch.load(base64.b64decode(payload, validate=True))
    except Exception as exc:
        raise ValueError(f"serialized_named_tensors: not base64 safetensors bytes "
                         f"({type(exc).__name__}: {exc})") from exc


def open_weight_group(master_address: str, master_port: int, rank: int, world_size: int,
                      backend: str = "gloo", timeout_s: float = 60.0):
    """Join (rank > 0) or host (rank 0) a weight-broadcast group of ``world_size`` processes."""
    if backend != "gloo":
        raise ValueError(f"backend: only 'gloo' is available here, got {backend!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, int(master_port), int(world_size), rank == 0, timeout=timeout,
                          wait_for_workers=False)
    return dist.ProcessGroupGloo(store, int(rank), int(world_size), timeout)


def broadcast_tensors(group, tensors: list[torch.Tensor]) -> None:
    """Broadcast each tensor from rank 0, in order (receivers pass preallocated tensors). Gloo has no float8 types:
    those (a low-precision stored form's values and scales) travel as their bytes."""
    for tensor in tensors:
        wire = tensor.view(torch.uint8) if tensor.dtype.is_floating_point and tensor.element_size() == 1 else tensor
        group.broadcast(wire, 0).wait()
