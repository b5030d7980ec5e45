"""Builtin training backends."""

from miles import hookimpl
from miles.train.torch_backend import TorchBackend


@hookimpl(trylast=True)
def miles_register_backends(register):
    register("torch", TorchBackend)
