"""Miles training backend on megatron-core (registered as ``megatron``)."""

import miles

# imported when first used: loading the plugin's entry point imports none of their dependencies
__getattr__ = miles.lazy_exports(__name__, {
    "MegatronBackend": "miles_megatron.backend",
})

__all__ = ["MegatronBackend"]
