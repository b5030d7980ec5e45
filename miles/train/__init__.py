"""The training plane: backend contract, the builtin torch backend, weight sync."""

from miles.train.backend import LossFn, TrainBackend
from miles.train.logprobs import token_logprobs

__all__ = ["LossFn", "TrainBackend", "token_logprobs"]
