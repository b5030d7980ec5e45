"""Entry point of the ``miles-daytona`` plugin (group ``miles``)."""

import miles


@miles.hookimpl
def miles_register_sandboxes(register):
    register("daytona", "miles_daytona.sandbox:DaytonaSandbox")
