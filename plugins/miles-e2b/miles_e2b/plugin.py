"""Entry point of the ``miles-e2b`` plugin (group ``miles``): registers the sandbox ``e2b``."""

import miles
from miles_e2b.sandbox import E2BSandbox


@miles.hookimpl
def miles_register_sandboxes(register):
    register("e2b", E2BSandbox)
