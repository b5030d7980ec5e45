"""Entry point of the ``miles-harbor`` plugin (group ``miles``)."""

import miles
from miles_harbor.data import harbor_tasks
from miles_harbor.env import HarborEnv


@miles.hookimpl
def miles_register_envs(register):
    register("harbor", HarborEnv)


@miles.hookimpl
def miles_register_data_generators(register):
    register("harbor_tasks", harbor_tasks)
