"""Entry point of the ``miles-megatron`` plugin (group ``miles``)."""

import miles


@miles.hookimpl
def miles_register_backends(register):
    register("megatron", "miles_megatron.backend:MegatronBackend")
