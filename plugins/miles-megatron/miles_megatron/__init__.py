"""Miles training backend on megatron-core (registered as ``megatron``)."""

from miles_megatron.backend import MegatronBackend

__all__ = ["MegatronBackend"]
