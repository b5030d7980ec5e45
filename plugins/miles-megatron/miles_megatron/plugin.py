"""Entry point of the ``miles-megatron`` plugin (group ``miles``)."""

import miles
from miles_megatron.backend import MegatronBackend


@miles.hookimpl
def miles_register_backends(register):
    register("megatron", MegatronBackend)
