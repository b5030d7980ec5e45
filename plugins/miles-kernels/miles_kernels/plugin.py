"""Entry point of the ``miles-kernels`` plugin (group ``miles``)."""

import miles


@miles.hookimpl
def miles_register_logprob_kernels(register):
    register("triton", "miles_kernels.kernel:TritonKernel")
