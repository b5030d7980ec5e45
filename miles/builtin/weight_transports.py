"""Builtin weight transports."""

from miles import hookimpl
from miles.weights.delta_transports import auto_transport, shm_transport, tensor_transport
from miles.weights.transports import (
    DiskTransport, DistributedTransport, InProcessTransport,
)


@hookimpl(trylast=True)
def miles_register_weight_transports(register):
    register("auto", auto_transport)  # AutoTransport, or with delta: true DeltaAutoTransport
    register("in_process", InProcessTransport)
    register("tensor", tensor_transport)  # TensorTransport, or with delta: true DeltaTensorTransport
    register("disk", DiskTransport)
    register("distributed", DistributedTransport)
    register("shm", shm_transport)  # SharedMemoryTransport, or with delta: true DeltaSharedMemoryTransport
