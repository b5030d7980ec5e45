"""Registers the builtin loggers ``jsonl``, ``tensorboard`` and ``wandb`` (:mod:`miles.run.loggers`)."""

from miles import hookimpl
from miles.run.loggers import JsonlLogger, TensorBoardLogger, WandbLogger


@hookimpl(trylast=True)
def miles_register_loggers(register):
    register("jsonl", JsonlLogger)
    register("tensorboard", TensorBoardLogger)
    register("wandb", WandbLogger)
