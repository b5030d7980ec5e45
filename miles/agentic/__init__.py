"""Agentic rollouts: environments, tools and tool parsers, sandboxes, token-exact chat turns."""

from miles.agentic.remote import PermanentError, RemoteSandbox
from miles.agentic.types import Action, EnvContext, ExecResult, Message, StepResult, Tool, ToolCall, ToolResult, tool

__all__ = ["Action", "EnvContext", "ExecResult", "Message", "PermanentError", "RemoteSandbox", "StepResult", "Tool",
           "ToolCall", "ToolResult", "tool"]
