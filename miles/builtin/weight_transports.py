"""Builtin weight transports."""

from miles import hookimpl
from miles.weights.transports import (
    AutoTransport, DiskTransport, DistributedTransport, InProcessTransport, SharedMemoryTransport, TensorTransport,
)


@hookimpl(trylast=True)
def miles_register_weight_transports(register):
    register("auto", AutoTransport)
    register("in_process", InProcessTransport)
    register("tensor", TensorTransport)
    register("disk", DiskTransport)
    register("distributed", DistributedTransport)
    register("shm", SharedMemoryTransport)
