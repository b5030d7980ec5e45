"""Entry point of the ``miles-e2b`` plugin (group ``miles``): registers the sandbox ``e2b``."""

import miles


@miles.hookimpl
def miles_register_sandboxes(register):
    register("e2b", "miles_e2b.sandbox:E2BSandbox")
