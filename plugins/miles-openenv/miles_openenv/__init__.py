"""Miles env plugin for OpenEnv environments: in process (``env``) or behind an OpenEnv server (``base_url``)."""

import miles

# imported when first used: loading the plugin's entry point imports none of their dependencies
__getattr__ = miles.lazy_exports(__name__, {
    "OpenEnvEnv": "miles_openenv.env",
    "OpenEnvFailure": "miles_openenv.sessions",
})

__all__ = ["OpenEnvEnv", "OpenEnvFailure"]
