"""Entry point of the ``miles-daytona`` plugin (group ``miles``)."""

import miles
from miles_daytona.sandbox import DaytonaSandbox


@miles.hookimpl
def miles_register_sandboxes(register):
    register("daytona", DaytonaSandbox)
