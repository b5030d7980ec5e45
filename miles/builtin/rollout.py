"""Builtin rollout functions."""

from miles import hookimpl
from miles.rollout.single_turn import single_turn


@hookimpl(trylast=True)
def miles_register_rollout_fns(register):
    register("single_turn", single_turn)
