"""Builtin rollout engines."""

from miles import hookimpl
from miles.engine.local import LocalEngine


@hookimpl(trylast=True)
def miles_register_rollout_engines(register):
    register("local", LocalEngine)
