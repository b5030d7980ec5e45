"""Entry point of the ``miles-harbor`` plugin (group ``miles``)."""

import miles


@miles.hookimpl
def miles_register_envs(register):
    register("harbor", "miles_harbor.env:HarborEnv")


@miles.hookimpl
def miles_register_data_generators(register):
    register("harbor_tasks", "miles_harbor.data:harbor_tasks")
