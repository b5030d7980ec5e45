"""Entry point of the ``miles-fsdp2`` plugin (group ``miles``)."""

import miles
from miles_fsdp2.backend import FSDP2Backend


@miles.hookimpl
def miles_register_backends(register):
    register("fsdp2", FSDP2Backend)
