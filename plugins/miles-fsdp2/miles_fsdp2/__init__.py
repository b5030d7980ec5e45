"""FSDP2 training backend for Miles: ``backend.name=fsdp2 backend.world_size=N``."""

import miles

# imported when first used: loading the plugin's entry point imports none of their dependencies
__getattr__ = miles.lazy_exports(__name__, {
    "FSDP2Backend": "miles_fsdp2.backend",
})

__all__ = ["FSDP2Backend"]
__version__ = "0.1.0"
