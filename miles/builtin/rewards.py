"""Registers the builtin rewards: the reward library of :mod:`miles.rewards`."""

from miles import hookimpl


@hookimpl(trylast=True)
def miles_register_rewards(register):
    register("exact_match", "miles.rewards.simple:exact_match")
    register("env", "miles.rewards.simple:env")
    register("math", "miles.rewards.math_answer:math_reward")
    register("multiple_choice", "miles.rewards.multiple_choice:multiple_choice")
    register("f1", "miles.rewards.token_f1:token_f1")
    register("format", "miles.rewards.format:FormatReward")
    register("code_tests", "miles.rewards.code_tests:CodeTests")
