"""Miles sandbox plugin for E2B cloud sandboxes (registered as ``e2b``)."""

from miles_e2b.sandbox import E2BError, E2BSandbox

__all__ = ["E2BError", "E2BSandbox"]
