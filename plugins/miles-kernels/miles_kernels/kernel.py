"""The ``triton`` log-prob kernel: Miles' kernel contract (``miles_register_logprob_kernels``) on Triton programs.

Triton compiles the same programs for NVIDIA GPUs (CUDA builds of torch) and AMD GPUs (ROCm builds, where
``torch.version.hip`` is set and ``torch.cuda`` drives the HIP device). On CPU tensors they run only under
Triton's interpreter (``TRITON_INTERPRET=1``, set before the first kernel runs), which the tests use.
Nothing here imports triton until a kernel runs, so the plugin costs nothing where it cannot.
"""

from __future__ import annotations

import importlib.util
import os
import sys

from miles import lazy_module

torch = lazy_module("torch")  # imported when a kernel is first asked about a device: `miles config` stays light

__all__ = ["TritonKernel", "gpu_backend"]

_PROGRAMS = "miles_kernels.triton_logprobs"


def _interpreting() -> bool:
    """Whether kernels run under Triton's interpreter: as imported, or as they would be imported now."""
    programs = sys.modules.get(_PROGRAMS)
    if programs is not None:
        return programs.INTERPRETED
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


def gpu_backend() -> str:
    """``rocm`` on a ROCm build of torch (``torch.version.hip``), else ``cuda``."""
    return "rocm" if getattr(torch.version, "hip", None) else "cuda"


class TritonKernel:
    """Registered as log-prob kernel ``triton``: fused log-softmax, log-prob and entropy, one Triton program
    per row, ``block`` vocabulary columns at a time (an online softmax in the forward pass).
    """

    def __init__(self, block: int = 4096, num_warps: int = 8) -> None:
        if block < 16 or block & (block - 1):
            raise ValueError(f"block must be a power of two >= 16, got {block}")
        self.block, self.num_warps = block, num_warps

    def unavailable(self, device: torch.device | str) -> str | None:
        device = torch.device(device)
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (CUDA and ROCm builds of torch bring it; else pip install triton)"
        if device.type == "cpu":
            if _interpreting():
                return None
            return ("Triton compiles for CUDA and ROCm GPUs, and this device is the CPU (TRITON_INTERPRET=1 runs "
                    "the kernels on CPU tensors through Triton's interpreter, slowly: for tests)")
        if device.type != "cuda":
            return f"Triton kernels here run on CUDA or ROCm devices, not {device.type}"
        if _interpreting():
            return "TRITON_INTERPRET=1 is set: Triton's interpreter runs on CPU tensors only"
        if not torch.cuda.is_available():
            return f"torch sees no {gpu_backend().upper()} device"
        return None

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        _check(logits)
        from miles_kernels import triton_logprobs

        return triton_logprobs.forward(logits, targets.contiguous(), self.block, self.num_warps)

    def backward(self, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
                 grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor | None) -> torch.Tensor:
        _check(logits)
        from miles_kernels import triton_logprobs

        grad_entropy = None if grad_entropy is None else grad_entropy.float().contiguous()
        return triton_logprobs.backward(logits, targets.contiguous(), lse.contiguous(), entropy.contiguous(),
                                        grad_logprobs.float().contiguous(), grad_entropy, self.block, self.num_warps)


def _check(logits: torch.Tensor) -> None:
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"the triton log-prob kernel takes [n, V] float32 logits with contiguous rows; got "
                         f"{tuple(logits.shape)} {logits.dtype} with strides {logits.stride()}")
