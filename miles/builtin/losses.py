"""Registers the builtin policy losses ``ppo_clip`` and ``sft`` (:mod:`miles.train.losses`)."""

from miles import hookimpl
from miles.train.losses import ppo_clip, sft


@hookimpl(trylast=True)
def miles_register_losses(register):
    register("ppo_clip", ppo_clip)
    register("sft", sft)
