"""Builtin log-prob kernels: ``torch``, the reference and the fallback of the chunked log-prob path."""

from miles import hookimpl
from miles.train.kernels import TorchKernel


@hookimpl(trylast=True)
def miles_register_logprob_kernels(register):
    register("torch", TorchKernel)
