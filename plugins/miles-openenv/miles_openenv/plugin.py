"""Entry point of the ``miles-openenv`` plugin (group ``miles``): registers env ``openenv``."""

import miles


@miles.hookimpl
def miles_register_envs(register):
    register("openenv", "miles_openenv.env:OpenEnvEnv")
