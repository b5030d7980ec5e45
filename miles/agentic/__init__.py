"""Agentic rollouts: environments, tools and tool parsers, sandboxes, token-exact chat turns."""

from miles.agentic.sandboxes.remote import PermanentError, RemoteSandbox
from miles.agentic.types import (
    CUT_MARKER, Action, EnvContext, ExecResult, Message, StepResult, Tool, ToolCall, ToolResult, tool,
)

__all__ = ["CUT_MARKER", "Action", "EnvContext", "ExecResult", "LocalSandbox", "Message", "PermanentError",
           "RemoteSandbox", "StepResult", "Tool", "ToolCall", "ToolResult", "tool"]


def __getattr__(name: str):
    if name == "LocalSandbox":  # the builtin `local` sandbox, for plugins that run commands on this machine
        from miles.agentic.sandboxes.local import LocalSandbox

        return LocalSandbox
    raise AttributeError(f"module 'miles.agentic' has no attribute {name!r}")
