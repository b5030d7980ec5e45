"""Entry point of the ``miles-sglang`` plugin (group ``miles``)."""

import miles


@miles.hookimpl
def miles_register_rollout_engines(register):
    register("sglang", "miles_sglang.launcher:SGLangLauncher")
