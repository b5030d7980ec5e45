"""Registers the builtin ``local`` sandbox (:mod:`miles.agentic.sandboxes.local`)."""

from miles import hookimpl


@hookimpl(trylast=True)
def miles_register_sandboxes(register):
    register("local", "miles.agentic.sandboxes.local:LocalSandbox")
