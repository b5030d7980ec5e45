"""The agentic contracts as data: what an environment step returns, what a sandbox run returns, a
parsed tool call, the action a policy turn becomes, and tools (plain functions with JSON schemas).

The protocols themselves (env, sandbox, tool parser) are documented in :mod:`miles.hookspecs`.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CUT_MARKER", "Action", "EnvContext", "ExecResult", "Message", "StepResult", "Tool", "ToolCall",
           "ToolResult", "tool"]

CUT_MARKER = "\n[... {} more bytes cut]"  # ends an output a sandbox cut; {}: how many bytes were left out
Message = dict[str, Any]  # an OpenAI-style chat message: {"role": ..., "content": ..., ...}


@dataclass
class StepResult:
    """What ``env.step(action)`` returns.

    ``observation`` is what the model sees next: a list of chat messages, one message, a string (one
    ``tool`` message after a turn with tool calls, else one ``user`` message) or None (nothing).
    ``reward`` (when not None on the last step) is the trajectory's reward unless a reward plugin is
    configured (``reward.name`` other than ``env``); ``done`` ends the trajectory.
    """

    observation: list[Message] | Message | str | None = None
    reward: float | dict[str, float] | None = None
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class ExecResult:
    """What ``sandbox.run(command, ...)`` returns. ``stdout``/``stderr`` are capped by the sandbox (a
    cut output ends with a marker saying how much was left out)."""

    stdout: str
    stderr: str
    exit_code: int | None  # None when the command was killed (timed out)
    timed_out: bool
    duration_s: float


@dataclass
class ToolCall:
    """One call parsed from a policy turn. ``error`` is set when the call is malformed, names an unknown
    tool or breaks the tool's JSON schema; such a call never reaches the environment."""

    name: str
    arguments: dict[str, Any]
    id: str = ""
    error: str | None = None

    def openai(self) -> dict[str, Any]:
        """The call in the OpenAI ``tool_calls`` shape (arguments as a JSON string)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments)}}


@dataclass
class Action:
    """One policy turn as an environment sees it: the generated text (special tokens removed), the
    valid tool calls in it, and the generated token ids. ``cut``: the turn stopped at its token limit
    (``rollout.sampling.max_new_tokens``) before the model ended it; the env may end the trajectory or answer
    (``multi_turn``'s ``on_cut_turn: env``, the default)."""

    text: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    cut: bool = False


@dataclass
class EnvContext:
    """What an env factory is given besides its config arguments, once per trajectory.

    ``sandbox`` is this trajectory's sandbox (opened on first use, closed with the env) or None when
    ``rollout.sandbox`` is not set; ``tool(name)`` finds a registered tool (or an import path).
    ``max_turns`` is the rollout function's limit of policy turns (None: none): the step of that turn is
    the env's last, so an env that scores at the end (runs a verifier) does it then.
    """

    sandbox_factory: Callable[[], Any] | None = None
    tool: Callable[[str], "Tool"] | None = None
    seed: int = 0
    max_turns: int | None = None
    _sandbox: Any = field(default=None, repr=False)

    @property
    def sandbox(self) -> Any:
        if self._sandbox is None:
            if self.sandbox_factory is None:
                raise RuntimeError("this environment needs a sandbox: set rollout.sandbox (e.g. {name: local})")
            self._sandbox = self.sandbox_factory()
        return self._sandbox

    def open_sandbox(self, **options: Any) -> Any:
        """Open this trajectory's sandbox with ``options`` over the configured ones (e.g. ``mounts`` and
        ``cwd`` for a task that expects its files at fixed paths); before any use of ``sandbox``."""
        if self._sandbox is not None:
            raise RuntimeError("this trajectory's sandbox is open already: call open_sandbox before using ctx.sandbox")
        if self.sandbox_factory is None:
            raise RuntimeError("this environment needs a sandbox: set rollout.sandbox (e.g. {name: local})")
        self._sandbox = self.sandbox_factory(**options)
        return self._sandbox

    async def close(self) -> None:
        sandbox, self._sandbox = self._sandbox, None
        if sandbox is not None:
            await sandbox.close()


@dataclass
class Tool:
    """A tool the model may call: a plain Python function with an OpenAI function schema.

    ``fn(**arguments)`` (sync or async) returns the observation (a :class:`ToolResult`, a string, or any
    value, JSON-encoded). With ``needs_sandbox`` it is called as ``fn(sandbox, timeout_s, **arguments)``
    with the trajectory's sandbox and the env's time limit per call.
    """

    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object
    fn: Callable[..., Any]
    needs_sandbox: bool = False

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI ``tools`` entry."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    async def __call__(self, arguments: dict[str, Any], sandbox: Any = None, timeout_s: float = 10.0) -> "ToolResult":
        """Run the tool; an exception becomes a failed result whose content names it."""
        try:
            result = self.fn(*((sandbox, timeout_s) if self.needs_sandbox else ()), **arguments)
            if inspect.isawaitable(result):
                result = await result
        except Exception as exc:
            return ToolResult(f"error: {type(exc).__name__}: {exc}", ok=False)
        if isinstance(result, ToolResult):
            return result
        return ToolResult(result if isinstance(result, str) else json.dumps(result))


@dataclass
class ToolResult:
    """A tool's answer: the observation text, whether the call succeeded, and for sandboxed code whether it
    timed out and how long it ran. A tool function may return one, or just the text."""

    content: str
    ok: bool = True
    timed_out: bool = False
    exec_s: float | None = None


_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}


def tool(fn: Callable | None = None, *, name: str | None = None, description: str | None = None,
         parameters: dict[str, Any] | None = None, needs_sandbox: bool = False) -> Any:
    """Make a :class:`Tool` from a function: ``@miles.tool`` or ``@miles.tool(parameters={...})``.

    Without ``parameters`` the schema comes from the annotations (int, float, str, bool, list, dict);
    parameters without a default are required. The description defaults to the docstring.
    """

    def make(fn: Callable) -> Tool:
        schema = parameters if parameters is not None else _schema_from_signature(fn, needs_sandbox)
        doc = description if description is not None else inspect.cleandoc(fn.__doc__ or "").split("\n\n")[0]
        return Tool(name or fn.__name__, doc, schema, fn, needs_sandbox)

    return make(fn) if fn is not None else make


def _schema_from_signature(fn: Callable, needs_sandbox: bool) -> dict[str, Any]:
    params = list(inspect.signature(fn).parameters.values())[2 if needs_sandbox else 0:]
    hints = inspect.get_annotations(fn, eval_str=True)
    properties, required = {}, []
    for p in params:
        json_type = _JSON_TYPES.get(hints.get(p.name))
        properties[p.name] = {"type": json_type} if json_type else {}
        if p.default is p.empty:
            required.append(p.name)
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
