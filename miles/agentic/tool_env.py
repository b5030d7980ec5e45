"""Builtin tools and the ``tool_env`` environment that offers registered tools to the model."""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

from miles.agentic.types import Action, EnvContext, StepResult, Tool, ToolResult, tool
from miles.hookspecs import takes_option

__all__ = ["ToolEnv", "execute_python_code"]

log = logging.getLogger(__name__)
_FRESH_ONLY: set[str] = set()  # sandbox classes said to run stateful calls fresh


@tool(parameters={"type": "object", "properties": {"code": {"type": "string", "description": "Python source to run"}},
                  "required": ["code"], "additionalProperties": False}, needs_sandbox=True)
async def execute_python_code(sandbox: Any, timeout_s: float, code: str, *, stateful: bool = False) -> ToolResult:
    """Run Python code in a sandbox and return what it prints (stdout, then stderr).

    Each call is a fresh ``python3``; with ``stateful`` (``tool_env``'s option) the calls of one trajectory run in
    the sandbox's persistent interpreter (``run_python``: the builtin ``local`` sandbox), variables kept. A sandbox
    with no such interpreter (the hosted ones) runs each call fresh, said once: a recipe runs unchanged on it."""
    run_python = getattr(sandbox, "run_python", None) if stateful else None
    if stateful and run_python is None and type(sandbox).__name__ not in _FRESH_ONLY:
        _FRESH_ONLY.add(type(sandbox).__name__)
        log.warning("rollout.env.stateful: %s has no persistent interpreter (run_python, as the builtin local "
                    "sandbox has): each execute_python_code call runs in a fresh python3, variables not kept",
                    type(sandbox).__name__)
    if run_python is not None:
        result = await run_python(code, timeout_s=timeout_s)
    else:
        result = await sandbox.run("python3 -I main.py", timeout_s=timeout_s, files={"main.py": code.encode()})
    if result.timed_out:
        text = f"{result.stdout}{result.stderr}error: timed out after {timeout_s:g} s"
    else:
        text = result.stdout + result.stderr
        if result.exit_code != 0 and not result.stderr:
            text += f"error: exit code {result.exit_code}"
    return ToolResult(text, ok=result.exit_code == 0 and not result.timed_out, timed_out=result.timed_out,
                      exec_s=result.duration_s)


class ToolEnv:
    """Offers the listed tools; each turn's valid calls run in order and their results come back as tool
    messages; the trajectory ends when the model answers without a tool call. Registered as env ``tool_env``.

    ``tools``: names of registered tools (or import paths); ``system_prompt``: a system message to start
    with; ``tool_timeout_s``: the limit per sandboxed call; ``max_observation_chars``: longer results are
    cut (the sandbox caps output too, but a small model's context is smaller still). ``stateful``: the tools that
    take a ``stateful`` keyword (``execute_python_code``) keep their state across the trajectory's turns.
    """

    def __init__(self, ctx: EnvContext, tools: list[str] = ("execute_python_code",), system_prompt: str | None = None,
                 tool_timeout_s: float = 10.0, max_observation_chars: int = 2000, stateful: bool = False) -> None:
        self.check_args({"tool_timeout_s": tool_timeout_s, "max_observation_chars": max_observation_chars,
                         "stateful": stateful})
        self.ctx, self.system_prompt = ctx, system_prompt
        self.timeout_s, self.max_chars = float(tool_timeout_s), int(max_observation_chars)
        self._tools: dict[str, Tool] = {t.name: t for t in (ctx.tool(name) for name in tools)}
        if stateful:
            keep = {name: t for name, t in self._tools.items() if takes_option(t.fn, "stateful")}
            if not keep:
                raise ValueError(f"stateful: none of the tools {list(self._tools)} keeps state (takes a 'stateful' "
                                 f"keyword, as execute_python_code does)")
            self._tools.update({name: dataclasses.replace(t, fn=functools.partial(t.fn, stateful=True))
                                for name, t in keep.items()})
        self.tools = [t.schema for t in self._tools.values()]

    @staticmethod
    def check_args(args: dict[str, Any]) -> None:
        """Config validation (a ValueError names the argument)."""
        if not args.get("tool_timeout_s", 1) > 0:
            raise ValueError(f"tool_timeout_s: expected a positive number of seconds, got {args['tool_timeout_s']!r}")
        if not args.get("max_observation_chars", 1) >= 1:
            raise ValueError(f"max_observation_chars: expected an integer >= 1, got {args['max_observation_chars']!r}")
        if not isinstance(args.get("stateful", False), bool):
            raise ValueError(f"stateful: expected true or false, got {args['stateful']!r}")

    async def reset(self, sample: Any) -> Any:
        if self.system_prompt is None:
            return None
        prompt = sample.prompt
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        return [{"role": "system", "content": self.system_prompt}, *messages]

    async def step(self, action: Action) -> StepResult:
        if not action.tool_calls:
            return StepResult(done=True)
        messages, results = [], []
        for call in action.tool_calls:
            t = self._tools[call.name]
            result = await t(call.arguments, self.ctx.sandbox if t.needs_sandbox else None, self.timeout_s)
            results.append(result)
            content = result.content
            if len(content) > self.max_chars:
                content = content[: self.max_chars] + f"\n[... {len(content) - self.max_chars} more characters cut]"
            messages.append({"role": "tool", "name": call.name, "tool_call_id": call.id, "content": content})
        return StepResult(observation=messages, info={"tool_results": results})

    async def close(self) -> None:
        pass
