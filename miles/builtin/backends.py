"""Builtin training backends."""

from miles import hookimpl


@hookimpl(trylast=True)
def miles_register_backends(register):
    register("torch", "miles.train.torch_backend:TorchBackend")
