"""Entry point of the ``miles-verifiers`` plugin (group ``miles``): the ``verifiers`` reward and the
``verifiers_tasks`` data generator. The agent (``rollout.fn: {name: agent, agent: miles_verifiers:rollout}``)
needs no registration: Miles' ``agent`` rollout function imports it, and calls its ``check_args`` at start."""

import miles


@miles.hookimpl
def miles_register_rewards(register):
    register("verifiers", "miles_verifiers.reward:VerifiersReward")


@miles.hookimpl
def miles_register_data_generators(register):
    register("verifiers_tasks", "miles_verifiers.data:verifiers_tasks")
