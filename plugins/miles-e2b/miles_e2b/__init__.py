"""Miles sandbox plugin for E2B cloud sandboxes (registered as ``e2b``)."""

import miles

# imported when first used: loading the plugin's entry point imports none of their dependencies
__getattr__ = miles.lazy_exports(__name__, {
    "E2BError": "miles_e2b.sandbox",
    "E2BSandbox": "miles_e2b.sandbox",
})

__all__ = ["E2BError", "E2BSandbox"]
