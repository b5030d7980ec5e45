"""The training plane: backend contract, the builtin torch backend, weight sync."""

from miles.lazy import lazy_exports

__all__ = ["LossFn", "TrainBackend", "token_logprobs"]

__getattr__ = lazy_exports(__name__, {"LossFn": "miles.train.backend", "TrainBackend": "miles.train.backend",
                                      "token_logprobs": "miles.train.logprobs"})
