"""Registers the builtin ``local`` sandbox (:mod:`miles.sandboxes.local`)."""

from miles import hookimpl
from miles.sandboxes.local import LocalSandbox


@hookimpl(trylast=True)
def miles_register_sandboxes(register):
    register("local", LocalSandbox)
