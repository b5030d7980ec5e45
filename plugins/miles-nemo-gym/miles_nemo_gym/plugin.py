"""Entry point of the ``miles-nemo-gym`` plugin (group ``miles``)."""

import miles


@miles.hookimpl
def miles_register_envs(register):
    register("nemo_gym", "miles_nemo_gym.env:NemoGymEnv")
