"""Daytona sandboxes for Miles: ``rollout.sandbox.name=daytona`` (credentials: ``DAYTONA_API_KEY``)."""

from miles_daytona.sandbox import DaytonaSandbox

__all__ = ["DaytonaSandbox"]
__version__ = "0.1.0"
