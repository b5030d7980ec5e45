"""Registers the builtin rewards: the reward library of :mod:`miles.rewards`."""

from miles import hookimpl
from miles.rewards import CodeTests, FormatReward, env, exact_match, math_reward, multiple_choice, token_f1


@hookimpl(trylast=True)
def miles_register_rewards(register):
    register("exact_match", exact_match)
    register("env", env)
    register("math", math_reward)
    register("multiple_choice", multiple_choice)
    register("f1", token_f1)
    register("format", FormatReward)
    register("code_tests", CodeTests)
