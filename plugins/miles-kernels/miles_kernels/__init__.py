"""Log-prob kernels for Miles' chunked log-prob path: ``backend.logprob_kernel=triton`` (or ``auto``)."""

from miles_kernels.kernel import TritonKernel

__all__ = ["TritonKernel"]
__version__ = "0.1.0"
