"""Builtin log-prob kernels: ``torch``, the reference and the fallback of the chunked log-prob path."""

from miles import hookimpl


@hookimpl(trylast=True)
def miles_register_logprob_kernels(register):
    register("torch", "miles.train.kernels:TorchKernel")
