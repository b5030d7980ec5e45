"""Registers the builtin ``local`` sandbox (:mod:`miles.agentic.sandboxes.local`)."""

from miles import hookimpl
from miles.agentic.sandboxes.local import LocalSandbox


@hookimpl(trylast=True)
def miles_register_sandboxes(register):
    register("local", LocalSandbox)
