"""How a policy turn becomes OpenEnv actions, and an OpenEnv observation the next message.

``action: tool`` offers the Action class's JSON schema as one tool; each valid call of it is one action
(its arguments are the Action's fields). ``action: text`` puts the turn's text into one field of the
Action. ``action: mcp`` offers the tools an MCP environment lists; each call is a ``CallToolAction``.
An observation is shown as one field of it (``observation_field``) or as its fields in JSON, without the
``done``, ``reward`` and ``metadata`` every observation has (an MCP tool's answer: its text).
"""

from __future__ import annotations

import json
import re
from typing import Any

from miles import Action, ToolCall

from miles_openenv.config import Settings, action_fields, check_action_schema

__all__ = ["ActionMapping", "McpActions", "TextActions", "ToolActions", "make_mapping", "render_observation",
           "snake_case"]

OBSERVATION_BASE_FIELDS = ("done", "reward", "metadata")


class ActionMapping:
    """The tools a mapping offers, and the OpenEnv action payloads (JSON objects) of a turn."""

    tools: list[dict[str, Any]]

    def payloads(self, action: Action) -> list[tuple[dict[str, Any], ToolCall | None]]:
        """The turn's actions in order, each with the call it came from (None in text mode)."""
        raise NotImplementedError

    def no_action(self) -> str | None:
        """What the model is told after a turn that holds no action (None: every turn holds one)."""
        return None

    def render(self, observation: dict[str, Any], field: str | None) -> str:
        """The text the model reads for an observation (:func:`render_observation`)."""
        return render_observation(observation, field)


class ToolActions(ActionMapping):
    """One tool whose parameters are the Action's JSON schema (without ``metadata``)."""

    def __init__(self, schema: dict[str, Any], name: str) -> None:
        self.name = name
        parameters = {k: v for k, v in schema.items() if k not in ("title", "description")}
        parameters["type"] = "object"
        parameters["properties"] = {k: v for k, v in schema.get("properties", {}).items() if k != "metadata"}
        if "required" in schema:
            parameters["required"] = [k for k in schema["required"] if k != "metadata"]
        description = schema.get("description") or f"Act in the environment: one {schema.get('title', 'action')}."
        self.tools = [{"type": "function",
                       "function": {"name": name, "description": description, "parameters": parameters}}]

    def payloads(self, action: Action) -> list[tuple[dict[str, Any], ToolCall | None]]:
        return [(dict(call.arguments), call) for call in action.tool_calls if call.name == self.name]

    def no_action(self) -> str:
        return f"error: no action taken; act by calling the tool {self.name}"


class TextActions(ActionMapping):
    """The turn's text (without surrounding whitespace) as the value of one field of the Action."""

    def __init__(self, field: str) -> None:
        self.field, self.tools = field, []

    def payloads(self, action: Action) -> list[tuple[dict[str, Any], ToolCall | None]]:
        return [({self.field: action.text.strip()}, None)]


class McpActions(ActionMapping):
    """The tools of an MCP environment (from its ``ListToolsAction`` answer), each call a ``CallToolAction``."""

    def __init__(self, listed: list[dict[str, Any]]) -> None:
        self.names = [tool["name"] for tool in listed]
        self.tools = [{"type": "function", "function": {
            "name": tool["name"], "description": tool.get("description") or "",
            "parameters": tool.get("input_schema") or {"type": "object", "properties": {}}}} for tool in listed]

    def payloads(self, action: Action) -> list[tuple[dict[str, Any], ToolCall | None]]:
        return [({"type": "call_tool", "tool_name": call.name, "arguments": dict(call.arguments)}, call)
                for call in action.tool_calls]

    def no_action(self) -> str:
        return f"error: no action taken; act by calling one of the tools {', '.join(self.names)}"

    def render(self, observation: dict[str, Any], field: str | None) -> str:
        """A tool's answer as its text content (``error: ...`` when the call failed); other observations (the
        reset one, and any with ``observation_field``) as :func:`render_observation` shows them."""
        if field is not None or "tool_name" not in observation:
            return render_observation(observation, field)
        if observation.get("error"):
            return f"error: {observation['error'].get('message', observation['error'])}"
        result = observation.get("result")
        if isinstance(result, dict) and isinstance(result.get("content"), list):
            text = "".join(part.get("text", "") for part in result["content"] if isinstance(part, dict))
            return f"error: {text}" if result.get("is_error") else text
        return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)


def make_mapping(settings: Settings, schema: dict[str, Any]) -> ActionMapping:
    """The mapping ``settings`` ask for (``tool`` or ``text``), over the Action's JSON schema (a ValueError when
    they do not fit)."""
    title = str(schema.get("title") or "Action")
    check_action_schema(schema, settings, title)
    if settings.action == "text":
        return TextActions(settings.action_field or action_fields(schema)[0])
    return ToolActions(schema, settings.tool_name or snake_case(title))


def render_observation(observation: dict[str, Any], field: str | None) -> str:
    """The observation's text: ``field``'s value (a string as it is, anything else as JSON), or all its own
    fields as JSON. A KeyError names a missing field and lists the ones there are."""
    own = {k: v for k, v in observation.items() if k not in OBSERVATION_BASE_FIELDS}
    if field is None:
        return json.dumps(own, ensure_ascii=False)
    if field not in own:
        raise KeyError(f"observation_field {field!r}: the observation has no such field; it has "
                       f"{', '.join(own) or 'none besides done, reward and metadata'}")
    value = own[field]
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def snake_case(name: str) -> str:
    """``CountAction`` -> ``count_action``, ``MCPAction`` -> ``mcp_action``; only characters a tool name may have."""
    words = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()
    return re.sub(r"[^a-z0-9_-]+", "_", words).strip("_")[:64] or "action"
