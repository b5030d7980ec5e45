"""Builtin weight transports."""

from miles import hookimpl


@hookimpl(trylast=True)
def miles_register_weight_transports(register):
    # auto, tensor and shm: with `delta: true` their delta-compressed variants (DeltaAutoTransport, ...)
    register("auto", "miles.weights.delta_transports:auto_transport")
    register("in_process", "miles.weights.transports:InProcessTransport")
    register("tensor", "miles.weights.delta_transports:tensor_transport")
    register("disk", "miles.weights.transports:DiskTransport")
    register("distributed", "miles.weights.transports:DistributedTransport")
    register("shm", "miles.weights.delta_transports:shm_transport")
