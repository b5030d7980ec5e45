"""Miles env plugin for OpenEnv environments: in process (``env``) or behind an OpenEnv server (``base_url``)."""

from miles_openenv.env import OpenEnvEnv
from miles_openenv.sessions import OpenEnvFailure

__all__ = ["OpenEnvEnv", "OpenEnvFailure"]
