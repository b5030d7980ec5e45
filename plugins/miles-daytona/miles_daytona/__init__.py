"""Daytona sandboxes for Miles: ``rollout.sandbox.name=daytona`` (credentials: ``DAYTONA_API_KEY``)."""

import miles

# imported when first used: loading the plugin's entry point imports none of their dependencies
__getattr__ = miles.lazy_exports(__name__, {
    "DaytonaSandbox": "miles_daytona.sandbox",
})

__all__ = ["DaytonaSandbox"]
__version__ = "0.1.0"
