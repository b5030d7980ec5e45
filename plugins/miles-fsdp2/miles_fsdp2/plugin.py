"""Entry point of the ``miles-fsdp2`` plugin (group ``miles``)."""

import miles


@miles.hookimpl
def miles_register_backends(register):
    register("fsdp2", "miles_fsdp2.backend:FSDP2Backend")
