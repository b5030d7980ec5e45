"""Registers the builtin loggers ``jsonl``, ``tensorboard`` and ``wandb`` (:mod:`miles.run.loggers`)."""

from miles import hookimpl


@hookimpl(trylast=True)
def miles_register_loggers(register):
    register("jsonl", "miles.run.loggers:JsonlLogger")
    register("tensorboard", "miles.run.loggers:TensorBoardLogger")
    register("wandb", "miles.run.loggers:WandbLogger")
