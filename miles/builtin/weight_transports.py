"""Builtin weight transports."""

from miles import hookimpl
from miles.train.weight_sync import InProcessTransport


@hookimpl(trylast=True)
def miles_register_weight_transports(register):
    register("in_process", InProcessTransport)
