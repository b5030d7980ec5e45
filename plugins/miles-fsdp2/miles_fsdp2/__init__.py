"""FSDP2 training backend for Miles: ``backend.name=fsdp2 backend.world_size=N``."""

from miles_fsdp2.backend import FSDP2Backend

__all__ = ["FSDP2Backend"]
__version__ = "0.1.0"
