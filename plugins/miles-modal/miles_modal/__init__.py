"""Modal sandboxes for Miles' agentic rollouts: ``rollout.sandbox: {name: modal}``."""

from miles_modal.sandbox import ModalSandbox

__all__ = ["ModalSandbox"]
__version__ = "0.1.0"
