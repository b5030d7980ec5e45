"""Registers the builtin policy losses ``ppo_clip`` and ``sft`` (:mod:`miles.train.losses`)."""

from miles import hookimpl


@hookimpl(trylast=True)
def miles_register_losses(register):
    register("ppo_clip", "miles.train.losses:ppo_clip")
    register("sft", "miles.train.losses:sft")
