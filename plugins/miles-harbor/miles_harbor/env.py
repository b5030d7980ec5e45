"""The ``harbor`` env: a Harbor task per trajectory, in the trajectory's Miles sandbox.

``reset`` finds the sample's task, opens the sandbox with the task's folders as mounts (``ctx.open_sandbox``)
and does what the task's Dockerfile does (:mod:`miles_harbor.dockerfile`); the model gets the instruction
and a ``bash`` tool. Each call runs in the sandbox. When the model answers without a call (or at the env's
``max_turns``), ``tests/test.sh`` runs in the same sandbox and its reward ends the trajectory
(:mod:`miles_harbor.verifier`).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from miles import Action, EnvContext, Sample, StepResult, ToolResult
from miles_harbor.provision import provision, script
from miles_harbor.task import HarborTask, find_tasks, load_task
from miles_harbor.verifier import run_verifier

__all__ = ["BASH_TOOL", "HarborEnv"]

BASH_TOOL = {"type": "function", "function": {
    "name": "bash",
    "description": "Run a shell command in the task's environment; returns its output (stdout, then stderr) "
                   "and its exit code when it failed.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["command"], "properties": {
        "command": {"type": "string", "description": "the command, run with /bin/sh -c in the task's working "
                                                     "directory"}}}}}


class HarborEnv:
    """Registered as env ``harbor``; needs ``rollout.sandbox`` (the local sandbox with bubblewrap).

    ``tasks``: a Harbor task directory, a folder of them, or a list of those. A sample's task is its data
    row's ``task_key`` field (``sample.metadata["data"]["task"]``), else its label. ``command_timeout_s``:
    the wall-clock limit of each command; ``max_observation_chars``: longer outputs are cut; ``max_turns``:
    when > 0, the verifier runs after that many turns even if the model still calls the tool (default: the
    rollout's ``max_turns``, so that the last turn is graded); ``system_prompt``: a system message first.
    """

    def __init__(self, ctx: EnvContext, tasks: str | list[str], task_key: str = "task",
                 command_timeout_s: float = 60.0, max_observation_chars: int = 4000, max_turns: int = 0,
                 system_prompt: str | None = None) -> None:
        self.check_args({"tasks": tasks, "command_timeout_s": command_timeout_s,
                         "max_observation_chars": max_observation_chars, "max_turns": max_turns})
        self.ctx, self.task_key, self.system_prompt = ctx, task_key, system_prompt
        self.timeout_s, self.max_chars, self.max_turns = float(command_timeout_s), max_observation_chars, max_turns
        self.tasks = _find_tasks(_paths(tasks))
        self.tools = [BASH_TOOL]
        self.task: HarborTask | None = None
        self.sandbox: Any = None
        self.steps = 0

    @staticmethod
    def check_args(args: dict[str, Any]) -> None:
        """Config validation (a ValueError names the argument): the tasks exist, the limits are positive."""
        _find_tasks(_paths(args.get("tasks")))
        timeout = args.get("command_timeout_s", 1)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            raise ValueError(f"command_timeout_s: expected a positive number of seconds, got {timeout!r}")
        for key, low in (("max_observation_chars", 1), ("max_turns", 0)):
            value = args.get(key, low)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{key}: expected an integer >= {low}, got {value!r}")

    async def reset(self, sample: Sample) -> list[dict[str, str]]:
        self.task = load_task(self.tasks[self._task_name(sample)])
        mounts = self.task.mounts()
        try:
            self.sandbox = self.ctx.open_sandbox(mounts=mounts, cwd=self.task.build.workdir)
        except TypeError as exc:
            raise ValueError(f"the harbor env needs a sandbox that takes mounts and cwd (rollout.sandbox: "
                             f"{{name: local, isolation: bwrap}}); this one does not: {exc}") from None
        except ValueError as exc:
            raise ValueError(f"task {self.task.name!r}: the sandbox cannot give the task its folders {mounts}: "
                             f"{exc}") from None
        await provision(self.sandbox, self.task.build, timeout_s=self.task.build_timeout_s, env=self.task.env)
        first = [{"role": "user", "content": self.task.instruction}]
        return [{"role": "system", "content": self.system_prompt}, *first] if self.system_prompt else first

    async def step(self, action: Action) -> StepResult:
        if self.task is None:
            raise RuntimeError("step before reset")
        self.steps += 1
        if not action.tool_calls:
            return await self._verify()
        results = [await self._bash(call.arguments["command"]) for call in action.tool_calls]
        messages = [{"role": "tool", "name": call.name, "tool_call_id": call.id, "content": result.content}
                    for call, result in zip(action.tool_calls, results)]
        limit = self.max_turns or self.ctx.max_turns
        if limit and self.steps >= limit:
            return await self._verify(results)
        return StepResult(observation=messages, info={"tool_results": results})

    async def close(self) -> None:
        pass  # the sandbox is the trajectory's: Miles closes it after the env

    def _task_name(self, sample: Sample) -> str:
        data = sample.metadata.get("data") or {}
        name = data.get(self.task_key, sample.label)
        if not isinstance(name, str) or not name:
            raise ValueError(f"this sample names no Harbor task: expected its data row's {self.task_key!r} field "
                             f"or its label to be a task name, got {name!r}")
        if name not in self.tasks:
            known = sorted(self.tasks)
            raise ValueError(f"unknown Harbor task {name!r}; the configured tasks are: "
                             f"{', '.join(known[:20])}{' ...' if len(known) > 20 else ''}")
        return name

    def _command(self, command: str) -> str:
        return script(command, dockerfile_env=self.task.build.env, env=self.task.env)

    async def _bash(self, command: str) -> ToolResult:
        result = await self.sandbox.run(self._command(command), timeout_s=self.timeout_s)
        text = result.stdout + result.stderr
        if len(text) > self.max_chars:
            text = text[:self.max_chars] + f"\n[... {len(text) - self.max_chars} more characters cut]"
        if result.timed_out:
            text += f"\n[timed out after {self.timeout_s:g} s]"
        elif result.exit_code != 0:
            text += f"\n[exit code {result.exit_code}]"
        return ToolResult(text, ok=result.exit_code == 0 and not result.timed_out, timed_out=result.timed_out,
                          exec_s=result.duration_s)

    async def _verify(self, results: list[ToolResult] | None = None) -> StepResult:
        reward, exit_code = await run_verifier(self.sandbox, self.task, dockerfile_env=self.task.build.env,
                                               env=self.task.env, cwd=self.task.build.workdir)
        info: dict[str, Any] = {"task": self.task.name, "test_exit_code": exit_code}
        if results is not None:
            info["tool_results"] = results
        return StepResult(reward=reward, done=True, info=info)


def _paths(tasks: Any) -> tuple[str, ...]:
    """``tasks`` as a tuple of paths (a config list may come as another sequence type)."""
    if isinstance(tasks, (str, os.PathLike)):
        return (str(tasks),)
    if isinstance(tasks, Sequence) and tasks and all(isinstance(p, (str, os.PathLike)) for p in tasks):
        return tuple(str(p) for p in tasks)
    raise ValueError(f"tasks: expected a directory of Harbor task directories (or a list of them), got {tasks!r}")


@functools.lru_cache(maxsize=64)
def _find_tasks(paths: tuple[str, ...]) -> dict[str, Path]:
    """The task folders, looked up once per config (every trajectory makes an env)."""
    return find_tasks(list(paths))
