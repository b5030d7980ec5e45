"""Entry point of the ``miles-sglang`` plugin (group ``miles``)."""

import miles
from miles_sglang.launcher import SGLangLauncher


@miles.hookimpl
def miles_register_rollout_engines(register):
    register("sglang", SGLangLauncher)
