"""Log-prob kernels for Miles' chunked log-prob path: ``backend.logprob_kernel=triton`` (or ``auto``)."""

import miles

# imported when first used: loading the plugin's entry point imports none of their dependencies
__getattr__ = miles.lazy_exports(__name__, {
    "TritonKernel": "miles_kernels.kernel",
})

__all__ = ["TritonKernel"]
__version__ = "0.1.0"
