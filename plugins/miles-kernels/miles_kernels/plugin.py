"""Entry point of the ``miles-kernels`` plugin (group ``miles``)."""

import miles
from miles_kernels.kernel import TritonKernel


@miles.hookimpl
def miles_register_logprob_kernels(register):
    register("triton", TritonKernel)
