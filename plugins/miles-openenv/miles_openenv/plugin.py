"""Entry point of the ``miles-openenv`` plugin (group ``miles``): registers env ``openenv``."""

import miles
from miles_openenv.env import OpenEnvEnv


@miles.hookimpl
def miles_register_envs(register):
    register("openenv", OpenEnvEnv)
