"""Entry point of the ``miles-nemo-gym`` plugin (group ``miles``)."""

import miles
from miles_nemo_gym.env import NemoGymEnv


@miles.hookimpl
def miles_register_envs(register):
    register("nemo_gym", NemoGymEnv)
