"""Modal sandboxes for Miles' agentic rollouts: ``rollout.sandbox: {name: modal}``."""

import miles

# imported when first used: loading the plugin's entry point imports none of their dependencies
__getattr__ = miles.lazy_exports(__name__, {
    "ModalSandbox": "miles_modal.sandbox",
})

__all__ = ["ModalSandbox"]
__version__ = "0.1.0"
