"""Loading a verifiers env from a spec, finding its tasks, and turning episodes and replies into rewards."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterator
from typing import Any

import verifiers.v1 as vf


def load_env(spec: dict[str, Any]) -> vf.Env:
    """The env a spec names: ``pkg.module:function`` called with ``env_args``, or a taskset id with ``env_args``
    as the rest of the verifiers ``[env]`` config (``agent``, ``taskset`` knobs, ``id`` of a paired Env)."""
    name, args = spec["env"], dict(spec.get("env_args") or {})
    if ":" in name:
        module_name, _, attr = name.partition(":")
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
        if not callable(obj):
            raise TypeError(f"{name} is a {type(obj).__name__}, expected a function returning a verifiers Env")
        env = obj(**args)
        if inspect.isawaitable(env):
            raise TypeError(f"{name} is async; expected a plain function returning a verifiers Env")
    else:
        taskset = args.pop("taskset", None) or {}
        if not isinstance(taskset, dict):
            raise TypeError(f"env_args.taskset must be a mapping of taskset settings, got {type(taskset).__name__}")
        env = vf.load_environment(vf.resolve_env_config({**args, "taskset": {**taskset, "id": name}}))
    if not isinstance(env, vf.Env):
        raise TypeError(f"{name} returned a {type(env).__name__}, expected a verifiers.v1.Env")
    return env


class Tasks:
    """The env's tasks, read from the taskset lazily: by position (``idx``, an int) or, in a finite taskset, by
    the task's ``id`` or ``key`` (a string)."""

    def __init__(self, env: vf.Env) -> None:
        self.taskset = env.taskset
        self._source: Iterator[vf.Task] = iter(env.taskset)
        self._read: list[vf.Task] = []
        self._exhausted = False

    def _extend(self, upto: int | None) -> None:
        """Read tasks until ``upto`` are held (None: all of them)."""
        while not self._exhausted and (upto is None or len(self._read) < upto):
            task = next(self._source, None)
            if task is None:
                self._exhausted = True
            else:
                self._read.append(task)

    def get(self, ref: int | str) -> vf.Task:
        if isinstance(ref, bool) or not isinstance(ref, (int, str)):
            raise TypeError(f"a task is named by its position (int) or its id or key (str), got {ref!r}")
        if isinstance(ref, int):
            if ref < 0:
                raise IndexError(f"task {ref}: positions start at 0")
            self._extend(ref + 1)
            if ref >= len(self._read):
                raise IndexError(f"task {ref}: the taskset has {len(self._read)} tasks (positions 0-"
                                 f"{len(self._read) - 1})")
            return self._read[ref]
        if not self.taskset.bounded:
            raise LookupError(f"task {ref!r}: an infinite taskset is addressed by position (an int), not by id")
        self._extend(None)
        for task in self._read:
            if ref in (task.data.id, task.key):
                return task
        raise LookupError(f"task {ref!r}: no task of the {len(self._read)} has this id or key")

    def head(self, limit: int | None) -> list[vf.Task]:
        """The first ``limit`` tasks (all of them when None; an infinite taskset needs a limit)."""
        if limit is None and not self.taskset.bounded:
            raise ValueError("the taskset is infinite: give a limit")
        self._extend(limit)
        return self._read[:limit]


def describe(task: vf.Task) -> dict[str, Any]:
    """A task as a Miles data row sees it."""
    data = task.data
    return {"idx": data.idx, "id": data.id, "key": task.key, "prompt": data.prompt_text or None}


def outcome(episode: vf.Episode) -> dict[str, Any]:
    """The reward of an episode's one trainable trace, with its named rewards and metrics; raises with the
    episode's or the trace's error when it failed."""
    if episode.errors:
        raise RuntimeError(_error_text(episode.errors[-1], "the episode"))
    trainable = [t for t in episode.traces if t.agent.trainable]
    if len(trainable) != 1:
        raise RuntimeError(f"the episode produced {len(trainable)} trainable traces; a Miles sample is one "
                           f"trajectory, so exactly one agent of the env may play the policy")
    trace = trainable[0]
    if not trace.ok:
        error = trace.last_error
        raise RuntimeError(_error_text(error, "the rollout") if error else "the rollout did not complete")
    return {**scores(trace), "turns": trace.num_turns, "stop": trace.stop_condition, "trace_id": trace.id}


def scores(trace: vf.Trace) -> dict[str, Any]:
    return {"reward": trace.reward,
            "rewards": {k: r.value for k, r in trace.rewards.items() if r is not None},
            "metrics": {k: v for k, v in trace.metrics.items() if v is not None}}


async def score_reply(task: vf.Task, prompt: str | list[dict[str, Any]], reply: str) -> dict[str, Any]:
    """Score one reply to a task's prompt with the task's rewards (single-turn): the trace is the prompt's
    messages followed by the reply as the one sampled turn. Rewards that need a runtime are skipped."""
    messages = [vf.UserMessage(content=prompt)] if isinstance(prompt, str) else [_message(m) for m in prompt]
    nodes = [vf.MessageNode(parent=i - 1 if i else None, message=m) for i, m in enumerate(messages)]
    nodes.append(vf.MessageNode(parent=len(nodes) - 1 if nodes else None,
                                message=vf.AssistantMessage(content=reply), sampled=True))
    trace = vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                     agent=vf.AgentInfo(config=vf.AgentConfig(runtime=vf.SubprocessConfig())), nodes=nodes)
    await task.score(trace)
    return scores(trace)


def _message(raw: Any) -> Any:
    if not isinstance(raw, dict) or raw.get("role") not in ("system", "user", "assistant"):
        raise ValueError(f"prompt messages are dicts with role system, user or assistant, got {raw!r}")
    kind = {"system": vf.SystemMessage, "user": vf.UserMessage, "assistant": vf.AssistantMessage}[raw["role"]]
    return kind(content=raw.get("content") or "")


def _error_text(error: vf.Error, what: str) -> str:
    return f"{what} failed: {error.type}: {error.message}"
